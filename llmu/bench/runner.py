"""Time the registered benchmark entries and turn timings into TFLOP/s, GB/s and % of peak.

On a CUDA device every provider is timed with ``triton.testing.do_bench`` (it flushes the L2
cache before each call and times with CUDA events). On a CPU only the providers of kind
``"torch"``, ``"builtin"`` and ``"external"`` are timed, with ``time.perf_counter`` around a loop,
after a warm-up, using as many threads as the process has: a Triton kernel on a CPU runs in the
interpreter, one numpy call per block, and its time says nothing about the kernel, so triton
providers are recorded as skipped, with the reason.

The numbers a row carries:

* ``ms``: the median time of one call (``ms_min``/``ms_max`` and the 20th/80th percentiles
  ``ms_p20``/``ms_p80`` show the spread; the median resists the outliers a shared machine makes);
* ``tflops = flops / (ms * 1e-3) / 1e12`` and ``gbs = bytes / (ms * 1e-3) / 1e9`` from the
  entry's own formulas;
* ``frac_flops`` and ``frac_bw``: those over the device's peaks (see :mod:`llmu.bench.peaks`);
  ``None`` when the peak is unknown (CPUs).

A learner's own kernel runs beside llmu's: ``run(names, yours={"vector_add": add})`` adds a row
``yours`` ("your kernel") to that entry, called with the same inputs as llmu's kernel. It is
timed where llmu's Triton kernels are (a CUDA device), after its output was checked against
llmu's kernel on the first size (a fast wrong answer is no result: such a row is an error, not a
time); on a CPU it is skipped with the reason, as llmu's own Triton rows are.
:func:`untimed_note` turns the skipped rows into the sentence a notebook prints under its plot.

While a notebook is being graded (``LLMU_AUTOGRADING=1`` in the environment, which the grading
code sets for the kernel: ``llmu grade``, ``autograder/autograde``) :func:`run` times nothing: each
entry and size gets a row with status ``"skipped"`` and reason ``"autograding"``. A benchmark
earns no points and would only spend the per-cell time limit.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from llmu import runtime
from llmu.bench.peaks import Peak, dtype_name, peak_for
from llmu.bench.registry import LOAD_ERRORS, Entry, Provider, load_all

#: Version of the results layout written by :func:`run` and read by :func:`llmu.bench.load`.
SCHEMA_VERSION = 1

#: Every result row has these keys (``None`` where a value does not apply).
ROW_FIELDS = (
    "entry", "module", "provider", "label", "kind", "size", "size_label", "x", "x_key", "dtype", "device",
    "status", "reason",
    "ms", "ms_min", "ms_max", "ms_p20", "ms_p80", "n_samples",
    "flops", "bytes", "tflops", "gbs", "frac_flops", "frac_bw",
)

CPU_KINDS = ("torch", "builtin", "external")
TRITON_ON_CPU = ("Triton runs in its interpreter here (numpy, one block at a time): its time says "
                 "nothing about the kernel; see the recorded GPU results")

#: The provider name and label of a learner's kernel passed to :func:`run` as ``yours=``.
YOURS = "yours"
YOURS_LABEL = "your kernel"

#: (rtol, atol) for comparing a learner's kernel with llmu's before timing it. Two correct kernels
#: may sum in different orders (other tile sizes, another reduction tree): in float32 that moves
#: the last few of ~7 significant digits over the sums these sizes make; a half-precision output
#: is rounded to 11 (float16) or 8 (bfloat16) significant bits, so one unit in the last place
#: (about 1e-3 and 8e-3 relative) times a few roundings. Integer and boolean outputs match exactly.
YOURS_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}

_REPO_ROOT = Path(__file__).resolve().parents[2]

#: The reason recorded on every row while a notebook is being graded.
AUTOGRADING_REASON = "autograding"


def autograding() -> bool:
    """True while grading code runs this process's notebook (``LLMU_AUTOGRADING`` set, not ``0``)."""
    return os.environ.get(runtime.AUTOGRADING_ENV, "").strip() not in ("", "0")


# --------------------------------------------------------------------------------------------
# Timers: each takes a zero-argument callable and returns a dict with "ms" and the spread.
# --------------------------------------------------------------------------------------------

def _summary(samples_ms: list[float]) -> dict:
    s = sorted(samples_ms)

    def q(p: float) -> float:  # linear interpolation between order statistics (numpy's default)
        pos = p * (len(s) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"ms": q(0.5), "ms_min": s[0], "ms_max": s[-1], "ms_p20": q(0.2), "ms_p80": q(0.8),
            "n_samples": len(s)}


def time_cpu(fn: Callable[[], object], repeats: int = 7, sample_s: float = 0.005,
             budget_s: float = 3.0) -> dict:
    """Median time of ``fn()`` in ms, on the CPU.

    Two warm-up calls (the first pays for lazy initialisation and allocations; the second gives
    an estimate), then ``repeats`` samples, each a loop of enough calls to last about ``sample_s``
    seconds so the clock's resolution does not matter. Slow calls get fewer samples (at least 3)
    so one measurement stays near ``budget_s``.
    """
    fn()
    t0 = time.perf_counter()
    fn()
    per_call = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, min(10_000, int(sample_s / per_call)))
    n = max(3, min(repeats, int(budget_s / (per_call * inner))))
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner * 1e3)
    return _summary(samples)


def time_cuda(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> dict:
    """Median time of ``fn()`` in ms on the current CUDA device, with ``triton.testing.do_bench``."""
    from triton.testing import do_bench

    try:
        times = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    except (AssertionError, TypeError):  # an older Triton without return_mode="all"
        q = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8, 0.0, 1.0])
        return {"ms": q[0], "ms_p20": q[1], "ms_p80": q[2], "ms_min": q[3], "ms_max": q[4],
                "n_samples": None}
    return _summary([float(t) for t in times])


# --------------------------------------------------------------------------------------------
# Arithmetic: time -> throughput -> fraction of peak.
# --------------------------------------------------------------------------------------------

def throughput(ms: float | None, flops: float | None, nbytes: float | None,
               peak: Peak | None = None, dtype=None) -> dict:
    """TFLOP/s, GB/s and the fractions of ``peak`` for one call taking ``ms`` milliseconds."""
    out = {"tflops": None, "gbs": None, "frac_flops": None, "frac_bw": None}
    if ms is None or not ms > 0:
        return out
    seconds = ms * 1e-3
    if flops is not None:
        out["tflops"] = flops / seconds / 1e12
    if nbytes is not None:
        out["gbs"] = nbytes / seconds / 1e9
    if peak is not None:
        peak_tflops = peak.tflops_for(dtype) if dtype is not None else None
        if out["tflops"] is not None and peak_tflops:
            out["frac_flops"] = out["tflops"] / peak_tflops
        if out["gbs"] is not None and peak.bandwidth_gbs:
            out["frac_bw"] = out["gbs"] / peak.bandwidth_gbs
    return out


# --------------------------------------------------------------------------------------------
# The environment recorded with every result.
# --------------------------------------------------------------------------------------------

def _gpu_driver() -> str | None:
    try:
        import pynvml  # nvidia-ml-py, present on most GPU images

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - fall back to the command-line tool
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip().splitlines()[0] or None
    except Exception:  # noqa: BLE001 - not known is an answer
        return None


def _git_commit() -> str | None:
    if not (_REPO_ROOT / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(_REPO_ROOT), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=5, check=True)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def environment_info(device: torch.device | str | None = None) -> dict:
    """``llmu.runtime.environment()`` plus what a benchmark needs to be read later: GPU name,
    driver and CUDA version, CPU count and the torch threads in use, llmu's version and commit."""
    import llmu

    dev = torch.device(device) if device is not None else runtime.device()
    env = runtime.environment().as_dict()
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count()
    env.update(
        llmu=llmu.__version__,
        git_commit=_git_commit(),
        platform=platform.platform(),
        cpu=platform.processor() or platform.machine(),
        cpu_count=cpus,
        threads=torch.get_num_threads(),
        bench_device=str(dev),
        cuda=torch.version.cuda,
        # Load average over 1 minute: above cpu_count, other processes competed for the cores
        # and CPU timings (multi-threaded ones most) are inflated.
        load_avg_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        gpu_name=None,
        gpu_driver=None,
        gpu_memory_gb=None,
        gpu_sm_count=None,
    )
    if dev.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(dev)
        env.update(gpu_name=props.name, gpu_driver=_gpu_driver(),
                   gpu_memory_gb=round(props.total_memory / 1e9, 1),
                   gpu_sm_count=props.multi_processor_count)
    return env


# --------------------------------------------------------------------------------------------
# Running entries.
# --------------------------------------------------------------------------------------------

def _select(registry: Mapping[str, Entry], names) -> list[Entry]:
    if names is None:
        return list(registry.values())
    if isinstance(names, str):
        names = [names]
    names = list(names)
    unknown = [n for n in names if n not in registry]
    if unknown:
        known = ", ".join(sorted(registry)) or "(none registered)"
        raise ValueError(f"unknown benchmark name(s) {', '.join(map(repr, unknown))}; known: {known}")
    return [registry[n] for n in names]


def size_label(size: Mapping) -> str:
    """``{"M": 64, "N": 128}`` -> ``"M=64 N=128"``."""
    return " ".join(f"{k}={v}" for k, v in size.items()) if size else "-"


def _x_axis(entry: Entry, size: Mapping) -> tuple[str | None, object]:
    """The size key plotted on the x axis (the entry's ``x_axis``, else the first key) and its value."""
    key = entry.x_axis if entry.x_axis is not None else next(iter(size), None)
    return key, size.get(key) if key is not None else None


def _blank_row(entry: Entry, size: Mapping, device: torch.device, dtype) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    x_key, x = _x_axis(entry, size)
    row.update(entry=entry.name, module=entry.module, size=dict(size), size_label=size_label(size),
               x=x, x_key=x_key, dtype=dtype_name(dtype) if dtype is not None else None,
               device=str(device))
    return row


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:300]


def _sizes_for(entry: Entry, sizes, on_gpu: bool) -> list[dict]:
    if isinstance(sizes, str):
        pick = {"auto": "gpu" if on_gpu else "cpu", "gpu": "gpu", "cpu": "cpu"}.get(sizes)
        if pick is None:
            raise ValueError(f"sizes must be 'auto', 'cpu', 'gpu' or a list of size dicts, got {sizes!r}")
        chosen = entry.gpu_sizes if pick == "gpu" else entry.cpu_sizes
        # An entry measured by run= with no sizes at all is called once, with an empty size.
        return [dict(s) for s in chosen] or ([{}] if entry.run is not None else [])
    return [dict(s) for s in sizes]


def _mismatch(expected, got) -> str | None:
    """Why ``got`` is not ``expected`` (tensors, or tuples/lists of them, or numbers), or None."""
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            return f"returned {type(got).__name__} of {len(got) if isinstance(got, (tuple, list)) else 1}, " \
                   f"llmu's kernel {type(expected).__name__} of {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            why = _mismatch(e, g)
            if why:
                return f"output {i}: {why}"
        return None
    if isinstance(got, (tuple, list)):
        return f"returned {type(got).__name__} of {len(got)}, llmu's kernel one {type(expected).__name__}"
    if got is None:
        return "returned None (return the output tensor)"
    expected, got = torch.as_tensor(expected), torch.as_tensor(got)
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)}, llmu's kernel gives {tuple(expected.shape)}"
    if expected.is_floating_point():
        rtol, atol = YOURS_TOLERANCE.get(expected.dtype, YOURS_TOLERANCE[torch.float32])
        a, b = got.detach().float().cpu(), expected.detach().float().cpu()
        bad = ~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        if bad.any():
            worst = (a - b).abs().nan_to_num(float("inf")).max().item()
            return f"{int(bad.sum())} of {bad.numel()} values differ (largest difference {worst:.3g})"
        return None
    if not torch.equal(got.detach().cpu(), expected.detach().cpu()):
        return f"{int((got.detach().cpu() != expected.detach().cpu()).sum())} values differ"
    return None


def _checked(provider, entry: Entry, inputs) -> str | None:
    """Run ``provider`` and the provider it is checked against on ``inputs``; why they differ, or None."""
    expected = entry.providers[provider.check_against].fn(*inputs)
    why = _mismatch(expected, provider.fn(*inputs))
    if why:
        label = entry.providers[provider.check_against].label or provider.check_against
        return f"wrong output, so not timed: against {label}, {why}"
    return None


def _kernels_timed_here(device: torch.device) -> bool:
    """Triton kernels are timed only where they compile: a CUDA device, not the interpreter."""
    return device.type == "cuda" and not runtime.interpreting()


def _time_providers(entry: Entry, size: dict, device: torch.device, dtype, timer, peak,
                    compiled_here: bool) -> list[dict]:
    rows = []
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    inputs, setup_error, flops, nbytes = None, None, None, None
    try:
        flops = float(entry.flops(size)) if entry.flops is not None else None
        nbytes = float(entry.bytes(size, elem_bytes)) if entry.bytes is not None else None
    except Exception as exc:  # noqa: BLE001 - a broken formula is reported, not timed
        setup_error = f"flops/bytes formula failed: {_short_error(exc)}"
    if setup_error is None and any(p.kind != "triton" or compiled_here for p in entry.providers.values()):
        try:
            inputs = entry.setup(size, device, dtype)
            if not isinstance(inputs, tuple):
                inputs = (inputs,)
        except Exception as exc:  # noqa: BLE001 - reported on each provider's row
            setup_error = f"setup failed: {_short_error(exc)}"
    for pname, provider in entry.providers.items():
        row = _blank_row(entry, size, device, dtype)
        row.update(provider=pname, label=provider.label or pname, kind=provider.kind,
                   flops=flops, bytes=nbytes)
        if provider.kind == "triton" and not compiled_here:
            row.update(status="skipped",
                       reason=TRITON_ON_CPU if runtime.interpreting() else "Triton kernels need a CUDA device")
        elif setup_error is not None:
            row.update(status="error", reason=setup_error)
        else:
            try:
                wrong = _checked(provider, entry, inputs) if provider.check_against else None
                if wrong:
                    row.update(status="error", reason=wrong)
                    rows.append(row)
                    continue
                stats = timer(functools.partial(provider.fn, *inputs))
            except ImportError as exc:  # an external library that is not installed here
                row.update(status="skipped", reason=f"not installed: {_short_error(exc)}")
            except Exception as exc:  # noqa: BLE001 - one failing provider must not stop the run
                row.update(status="error", reason=_short_error(exc))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            else:
                row.update({k: stats.get(k) for k in ("ms", "ms_min", "ms_max", "ms_p20", "ms_p80",
                                                      "n_samples")})
                row.update(throughput(row["ms"], flops, nbytes, peak, dtype))
                row["status"] = "ok"
        rows.append(row)
    del inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _run_whole(entry: Entry, size: dict, device: torch.device, dtype, peak) -> list[dict]:
    """An entry with ``run=`` measures itself (tokens per second, say): fill in the common keys."""
    try:
        produced = entry.run(size, device)
    except Exception as exc:  # noqa: BLE001
        row = _blank_row(entry, size, device, dtype)
        row.update(status="error", reason=_short_error(exc))
        return [row]
    rows = []
    for r in produced:
        row = _blank_row(entry, size, device, dtype)
        row["status"] = "ok"
        row.update(r)
        if isinstance(row["dtype"], torch.dtype):
            row["dtype"] = dtype_name(row["dtype"])
        if row["ms"] is not None and row["tflops"] is None and row["gbs"] is None:
            row.update(throughput(row["ms"], row["flops"], row["bytes"], peak, row["dtype"]))
        rows.append(row)
    return rows


def run(names: str | Iterable[str] | None = None, device=None, sizes="auto", repeats: int | None = None,
        *, entries: Mapping[str, Entry] | Iterable[Entry] | None = None,
        timer: Callable[[Callable[[], object]], dict] | None = None,
        progress: Callable[[dict], None] | None = None,
        budget_s: float | None = None, threads: int | None = None,
        yours: Mapping[str, Callable] | None = None) -> dict:
    """Run benchmark entries and return JSON-ready results.

    ``names``: entry names (all when None; an unknown name raises ValueError listing the known
    ones). ``device``: where to run (llmu's default device when None). ``sizes``: ``"auto"`` (the
    entry's GPU sizes on CUDA, its CPU sizes otherwise), ``"gpu"``, ``"cpu"``, or an explicit list
    of size dicts. ``repeats``: timed samples per measurement on the CPU (default 7; on CUDA
    ``do_bench`` samples for 100 ms instead).

    ``entries`` replaces the global registry (a mapping or an iterable of :class:`Entry`): tests
    and notebooks use it for an entry of their own. ``timer(fn) -> {"ms": ..., ...}`` replaces the
    clock. ``progress(row)`` is called as each row is done. ``budget_s`` bounds the whole run:
    sizes not started in time are recorded as skipped. ``threads`` sets torch's CPU threads for
    the run (default: as the process has them). On a machine whose cores are busy with other
    work, one thread gives steadier CPU timings: a multi-threaded op waits for every thread to be
    scheduled.

    ``yours``: ``{entry name: function}``, a learner's kernels, each added to its entry as the
    provider ``"yours"`` and called like the entry's llmu kernel (``fn(*inputs)``). Timed where
    llmu's Triton kernels are, once its output matches llmu's kernel (``YOURS_TOLERANCE``);
    skipped on a CPU, with the reason (:func:`untimed_note`).

    Returns ``{"schema_version", "created", "environment", "peak", "sizes", "rows",
    "load_errors"}``; each row has the keys in :data:`ROW_FIELDS`.
    """
    if entries is None:
        registry = load_all(strict=False)
        load_errors = dict(LOAD_ERRORS)
    else:
        registry = dict(entries) if isinstance(entries, Mapping) else {e.name: e for e in entries}
        load_errors = {}
    selected = _select(registry, names)
    if yours is not None:
        selected = _with_yours(selected, yours)
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dev = torch.device(device) if device is not None else runtime.device()
        on_gpu = dev.type == "cuda"
        compiled_here = _kernels_timed_here(dev)
        env = environment_info(dev)
        peak = peak_for(env["gpu_name"]) if on_gpu else None
        if timer is None:
            timer = time_cuda if on_gpu else (lambda fn: time_cpu(fn, repeats=repeats or 7))
        started = time.perf_counter()
        grading = autograding()
        rows: list[dict] = []

        def emit(new_rows):
            for row in new_rows:
                rows.append(row)
                if progress is not None:
                    progress(row)

        for entry in selected:
            dtype = entry.gpu_dtype if on_gpu else entry.cpu_dtype
            if on_gpu and dtype == torch.bfloat16 and not runtime.supports_bf16(dev):
                dtype = torch.float16  # a T4 (compute capability 7.5) has no bf16: its 16-bit type is fp16
            entry_sizes = _sizes_for(entry, sizes, on_gpu)
            if not entry_sizes:
                row = _blank_row(entry, {}, dev, dtype)
                row.update(status="skipped", reason=f"no {'GPU' if on_gpu else 'CPU'} sizes registered")
                emit([row])
                continue
            for size in entry_sizes:
                if grading:
                    row = _blank_row(entry, size, dev, dtype)
                    row.update(status="skipped", reason=AUTOGRADING_REASON)
                    emit([row])
                    continue
                if budget_s is not None and time.perf_counter() - started > budget_s:
                    row = _blank_row(entry, size, dev, dtype)
                    row.update(status="skipped", reason=f"time budget of {budget_s:g} s used up")
                    emit([row])
                    continue
                if entry.run is not None:
                    emit(_run_whole(entry, size, dev, dtype, peak))
                else:
                    emit(_time_providers(entry, size, dev, dtype, timer, peak, compiled_here))

        return make_results(rows, env, sizes, load_errors)
    finally:
        if threads is not None:
            torch.set_num_threads(previous_threads)


def _with_yours(selected: list[Entry], yours) -> list[Entry]:
    """``selected`` with each learner's kernel of ``yours`` added to its entry (copies: the registry
    is left as it is)."""
    if not isinstance(yours, Mapping):
        raise TypeError(f"yours must be a dict of entry name -> your function, got {type(yours).__name__}")
    by_name = {e.name: e for e in selected}
    unknown = [name for name in yours if name not in by_name]
    if unknown:
        raise ValueError(f"yours names {', '.join(map(repr, unknown))}, which this run does not include; "
                         f"it runs {', '.join(by_name) or 'no entry'}")
    out = []
    for entry in selected:
        fn = yours.get(entry.name)
        if fn is None:
            out.append(entry)
            continue
        if not callable(fn):
            raise TypeError(f"yours[{entry.name!r}] must be a function called like llmu's kernel, "
                            f"got {type(fn).__name__}")
        if entry.run is not None:
            raise ValueError(f"yours[{entry.name!r}]: {entry.name} measures a whole model, not one kernel")
        kernels = [n for n, p in entry.providers.items() if p.kind == "triton"]
        if not kernels:
            raise ValueError(f"yours[{entry.name!r}]: {entry.name} has no Triton kernel of llmu's to set yours beside")
        provider = Provider(fn, "triton", YOURS_LABEL, check_against=kernels[0])
        out.append(dataclasses.replace(entry, providers={**entry.providers, YOURS: provider}))
    return out


def untimed_note(results: Mapping) -> str:
    """What a notebook prints under its benchmark: which rows were not timed here, and why (one line
    per reason, each naming the providers), or ``""`` when every row was timed."""
    if not isinstance(results, Mapping) or "rows" not in results:
        raise TypeError("results must be what llmu.bench.run returned (a dict with 'rows')")
    reasons: dict[str, list[str]] = {}
    for row in results["rows"]:
        if row.get("status") in ("skipped", "error"):
            who = row.get("label") or row.get("provider") or row.get("entry")
            names = reasons.setdefault(f"{row['status']}: {row.get('reason')}", [])
            if who not in names:
                names.append(who)
    return "\n".join(f"not timed here ({', '.join(names)}): {reason.split(': ', 1)[1]}"
                     if reason.startswith("skipped") else f"failed ({', '.join(names)}): {reason.split(': ', 1)[1]}"
                     for reason, names in reasons.items())


def make_results(rows: list[dict], env: dict, sizes="auto", load_errors: Mapping | None = None,
                 **extra) -> dict:
    """The results dict :func:`run` returns, around ``rows`` measured in environment ``env``
    (also used to save the rows of a run that was interrupted)."""
    peak = peak_for(env.get("gpu_name")) if env.get("gpu_name") else None
    return {
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": env,
        "peak": peak.as_dict() if peak is not None else None,
        "sizes": sizes if isinstance(sizes, str) else "custom",
        "rows": list(rows),
        "load_errors": dict(load_errors or {}),
        **extra,
    }
