"""Compile a launcher's kernels for a GPU this machine does not have.

How it works, in three steps:

1. The process runs in llmu's *compile-only* mode (``LLMU_COMPILE_ONLY=1``, see :mod:`llmu.runtime`):
   ``@triton.jit`` makes real ``JITFunction`` objects (not interpreted ones), launchers think they
   are on a GPU (``runtime.interpreting()`` is False, so they pick their GPU tile sizes, warps,
   stages and compiled-only branches) but take CPU tensors (``runtime.kernel_device()`` is CPU).
2. :func:`install` replaces ``JITFunction.run`` — what ``kernel[grid](...)`` calls — by a hook that
   does not launch anything: it asks Triton to *compile* the kernel with exactly the arguments,
   constexprs and options the launcher gave (``warmup=True``), for the target of the moment.
3. The target comes from a stand-in for Triton's CUDA driver (:class:`TargetDriver`) that answers
   "which GPU is this?" with ``GPUTarget("cuda", 90, 32)`` (or 80, 75). Triton then lowers the
   kernel to PTX and runs ``ptxas`` from its own wheel to a cubin: every step a GPU would run,
   minus loading the binary.

What a GPU would refuse at load time is checked here instead: the shared memory the compiled
kernel asks for against the architecture's limit. ``ptxas -v`` reports registers and spills.

A *record* (:func:`use_record`) skips compiles whose outcome is already known. Triton names each
compile by a hash of everything that decides its result: the kernel's source and the source of
every function it calls, the constexprs, the argument types and their specialization (alignment,
divisibility by 16), the options (warps, stages), the target, and Triton's own version and files
(the hash of its cache, ``triton.compiler.compile``). A record maps such hashes to what the compile
gave (shared memory, registers, spills). A launch whose hash is in the record takes those figures
without compiling; anything that changed (an edited kernel, a new configuration, another Triton)
has a new hash and is compiled. The first launch of each kernel for each target is always compiled
for real and must agree with the record, so a record that does not belong to this compiler fails
the check instead of hiding a fault.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from dataclasses import asdict, dataclass, field

import torch

from llmu import runtime

#: name -> (compute capability as Triton writes it, max shared memory per block in bytes (the opt-in
#: limit of CUDA's programming guide), streaming multiprocessors of the GPU named last)
TARGETS: dict[str, tuple[int, int, int, str]] = {
    "sm_90": (90, runtime.SHARED_MEMORY_PER_BLOCK[(9, 0)], 132, "H100 / H200 SXM"),
    "sm_80": (80, runtime.SHARED_MEMORY_PER_BLOCK[(8, 0)], 108, "A100"),
    "sm_75": (75, runtime.SHARED_MEMORY_PER_BLOCK[(7, 5)], 40, "T4 (Colab's free GPU)"),
}

_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass
class Row:
    """One kernel compiled at one configuration for one target (or a launch the launcher refused)."""

    kernel: str                 # module:function of the @triton.jit kernel ("" when refused)
    case: str                   # the launch case that reached it (llmu.gpu_compile.cases)
    target: str                 # sm_90, sm_80 or sm_75
    dtype: str                  # the dtype the case was run with
    config: str = ""            # constexprs, num_warps, num_stages as the launcher chose them
    signature: str = ""         # pointer and scalar types of the non-constexpr arguments
    shared: int | None = None   # bytes of shared memory the compiled kernel needs
    shared_limit: int = 0
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    status: str = "ok"          # ok | refused (the launcher said why) | error
    message: str = ""
    hash: str = ""              # Triton's hash of the compile (its cache key)
    source: str = "compiled"    # compiled | record (its hash was in the record: not compiled again)

    def as_dict(self) -> dict:
        return asdict(self)


class TargetDriver:
    """Just enough of Triton's CUDA driver for ``JITFunction.run(warmup=True)`` to compile for
    ``target`` without a GPU. Each target gets its own "device" number so that Triton's per-device
    kernel caches never hand a kernel compiled for one architecture to another."""

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget

        self.capability = capability
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.capability

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@dataclass
class _Session:
    """What the hook needs to know about the launch being made, and what it has found."""

    target: str = ""
    case: str = ""
    dtype: str = ""
    rows: list[Row] = field(default_factory=list)
    launched: set = field(default_factory=set)            # JITFunction objects compiled at least once
    ptxas: dict = field(default_factory=dict)             # compiled kernel hash -> (regs, stores, loads)
    record: dict | None = None                            # hash -> outcome, when a record is in use
    compiled_for_real: set = field(default_factory=set)   # (kernel, target) compiled at least once
    force_compile: bool = False                           # the launch being made must really compile


SESSION = _Session()
_ORIGINAL_RUN = None


def _report_path(kernel_hash: str) -> str | None:
    """One small file per compiled kernel beside Triton's cache: processes that compile at the same
    time (the tests run one per target) never overwrite each other's reports."""
    cache = os.environ.get("TRITON_CACHE_DIR")
    return os.path.join(cache, "llmu-ptxas", f"{kernel_hash}.json") if cache else None


def _load_report(kernel_hash: str):
    path = _report_path(kernel_hash)
    if path and os.path.exists(path):
        with open(path) as f:
            return tuple(json.load(f))
    return None


def _save_report(kernel_hash: str, report: tuple) -> None:
    path = _report_path(kernel_hash)
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, path)


#: What a record keeps of each compile, besides its hash.
RECORD_FIELDS = ("kernel", "target", "shared", "registers", "spill_stores", "spill_loads", "num_warps", "num_stages")


def use_record(entries: dict) -> None:
    """Trust ``entries`` (``{hash: {field: value}}``, see :data:`RECORD_FIELDS`) for the launches of
    this process, as the module docstring explains."""
    if not isinstance(entries, dict):
        raise TypeError(f"entries must be a dict of hash -> outcome, got {type(entries).__name__}")
    SESSION.record = entries


def record_entries(rows) -> dict:
    """The record of ``rows``: ``{hash: outcome}`` for every compile that succeeded."""
    return {r.hash: {f: getattr(r, f) for f in RECORD_FIELDS}
            for r in rows if r.status == "ok" and r.hash and r.registers is not None}


class _Recorded:
    """What the JIT gets back instead of a ``CompiledKernel`` for a launch found in the record: only
    what the hook reads (the hash and the metadata); nothing can launch it, and nothing tries."""

    def __init__(self, hash: str, entry: dict, name: str):
        from collections import namedtuple

        self.hash = hash
        meta = namedtuple("RecordedMetadata", "name shared num_warps num_stages")
        self.metadata = meta(name, entry["shared"], entry["num_warps"], entry["num_stages"])


def _compile_or_recall(src, target=None, options=None, _env_vars=None):
    """``triton.compiler.compile``, unless the record already holds this compile's outcome. The hash
    is computed exactly as ``compile`` computes it before looking in its own cache."""
    import hashlib

    from triton.compiler import compiler  # its own names, as compile() sees them

    record = SESSION.record
    if record and not SESSION.force_compile and not isinstance(src, str):
        backend = compiler.make_backend(target)
        parsed = backend.parse_options(dict(options or {}, **src.parse_options()))
        env_vars = compiler.get_cache_invalidating_env_vars() if _env_vars is None else _env_vars
        key = compiler.get_cache_key(src, backend, parsed, env_vars=env_vars)
        hash = hashlib.sha256(key.encode("utf-8")).hexdigest()
        if hash in record:
            return _Recorded(hash, record[hash], src.name)
    return compiler.compile(src, target=target, options=options, _env_vars=_env_vars)


def _kernel_name(fn) -> str:
    return f"{fn.fn.__module__}:{fn.fn.__name__}"


def _describe(jit_fn, args, kwargs) -> tuple[str, str]:
    """(config, signature): the constexprs and launch options, and the types of the other arguments."""
    names = [p.name for p in jit_fn.params]
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    consts, types = [], []
    for p in jit_fn.params:
        if p.name not in bound:
            continue
        v = bound[p.name]
        if p.is_constexpr:
            consts.append(f"{p.name}={v}")
        elif isinstance(v, torch.Tensor):
            types.append(f"*{str(v.dtype).removeprefix('torch.')}")
        elif v is None:
            types.append("None")
        else:
            types.append(type(v).__name__)
    options = [f"{k}={kwargs[k]}" for k in ("num_warps", "num_stages") if k in kwargs]
    return " ".join(consts + options), ",".join(types)


def _compile_hook(self, *args, grid, warmup, **kwargs):
    """Replaces ``JITFunction.run``: compile for the session's target, record a row, launch nothing."""
    from triton import knobs
    from triton.runtime.driver import driver

    capability, limit, _, _ = TARGETS[SESSION.target]
    config, signature = _describe(self, args, kwargs)
    row = Row(kernel=_kernel_name(self), case=SESSION.case, target=SESSION.target, dtype=SESSION.dtype,
              config=config, signature=signature, shared_limit=limit)
    previous = driver._active
    log = io.StringIO()
    # With a record, the first launch of each kernel for each target compiles regardless.
    SESSION.force_compile = (row.kernel, row.target) not in SESSION.compiled_for_real
    try:
        driver.set_active(TargetDriver(capability))
        knobs.nvidia.dump_ptxas_log = True   # ptxas -v output (registers, spills) goes to stdout
        with contextlib.redirect_stdout(log):
            compiled = _ORIGINAL_RUN(self, *args, grid=grid, warmup=True, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a compile error is this check's finding
        row.status, row.message = "error", f"{type(exc).__name__}: {exc}".strip()[:2000]
        SESSION.rows.append(row)
        return None
    finally:
        knobs.nvidia.dump_ptxas_log = False
        driver._active = previous
    SESSION.launched.add(self)
    meta = compiled.metadata
    row.shared, row.hash = int(meta.shared), compiled.hash
    text = log.getvalue()
    if isinstance(compiled, _Recorded):
        row.source = "record"
        entry = SESSION.record[compiled.hash]
        SESSION.ptxas[compiled.hash] = (entry["registers"], entry["spill_stores"], entry["spill_loads"])
    elif text:  # a fresh compile; a kernel served from Triton's caches printed nothing
        regs, spills = _REGISTERS.findall(text), _SPILLS.findall(text)
        SESSION.ptxas[compiled.hash] = (int(regs[-1]) if regs else None,
                                        int(spills[-1][0]) if spills else None,
                                        int(spills[-1][1]) if spills else None)
        _save_report(compiled.hash, SESSION.ptxas[compiled.hash])
    elif compiled.hash not in SESSION.ptxas:
        SESSION.ptxas[compiled.hash] = _load_report(compiled.hash) or (None, None, None)
    row.registers, row.spill_stores, row.spill_loads = SESSION.ptxas[compiled.hash]
    row.num_warps, row.num_stages = int(meta.num_warps), int(meta.num_stages)
    if row.source == "compiled":
        SESSION.compiled_for_real.add((row.kernel, row.target))
        recorded = (SESSION.record or {}).get(row.hash)
        if recorded is not None:
            found = {f: getattr(row, f) for f in RECORD_FIELDS}
            differ = {f: (recorded.get(f), found[f]) for f in RECORD_FIELDS if recorded.get(f) != found[f]}
            if differ:
                row.status = "error"
                row.message = ("the record disagrees with the compiler here (" +
                               ", ".join(f"{f}: recorded {a}, compiled {b}" for f, (a, b) in differ.items()) +
                               "): the record was not made by this Triton; write it again")
                SESSION.rows.append(row)
                return None
    for option in ("num_warps", "num_stages"):  # the defaults, when the launcher left them to Triton
        if f"{option}=" not in row.config:
            row.config = f"{row.config} {option}={getattr(meta, option)}".strip()
    if row.shared > limit and row.status == "ok":
        row.status = "error"
        row.message = f"needs {row.shared} B of shared memory; {SESSION.target} allows {limit} B per block"
    SESSION.rows.append(row)
    return None


def install() -> None:
    """Route every kernel launch of this process through :func:`_compile_hook` (compile-only mode only)."""
    global _ORIGINAL_RUN
    if runtime.triton_mode() != "compile-only":
        raise RuntimeError("llmu.gpu_compile.capture.install() needs LLMU_COMPILE_ONLY=1 set before llmu is imported "
                           "(run `llmu gpu-compile`, which starts such a process)")
    from triton.runtime.jit import JITFunction

    if _ORIGINAL_RUN is None:
        import triton.compiler

        _ORIGINAL_RUN = JITFunction.run
        JITFunction.run = _compile_hook
        # JITFunction.create_binder imports `compile` from here when it first meets a device
        triton.compiler.compile = _compile_or_recall


@contextlib.contextmanager
def compiling_for(target: str):
    """Launchers called inside compile for ``target`` and see its compute capability
    (``runtime.capability()``, ``runtime.sm_count()``), so a launcher can pick fp16 or smaller tiles
    on a T4 and size its grid to the GPU's multiprocessors."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {sorted(TARGETS)}, got {target!r}")
    previous = (SESSION.target, runtime._TARGET_CAPABILITY, runtime._TARGET_SM_COUNT)
    cap, _, sms, _ = TARGETS[target]
    SESSION.target, runtime._TARGET_CAPABILITY, runtime._TARGET_SM_COUNT = target, (cap // 10, cap % 10), sms
    try:
        yield
    finally:
        SESSION.target, runtime._TARGET_CAPABILITY, runtime._TARGET_SM_COUNT = previous
