"""Where llmu's code runs: the torch device and the Triton mode.

Triton kernels compile to GPU code when a CUDA device is present. Without one, Triton's
interpreter runs the very same ``@triton.jit`` functions on CPU tensors (through numpy), which is
how every kernel of the course can be written, graded and tested on a laptop or a Binder.

The interpreter is switched on by the environment variable ``TRITON_INTERPRET=1``, and Triton reads
it when a kernel is *defined*. This module therefore sets it before anything in llmu imports
triton: ``import llmu`` imports this module first. A value the user set is always respected.

It gives torch as many CPU threads as the process may really use (:func:`configure_threads`): in a
container (Docker, Binder, Kubernetes) that is the CPU quota of its control group, often 1 or 2,
while torch counts the host's cores and oversubscribes them several times over.

It also keeps notebooks inside small memory limits (Binder and Colab give 2 GB or so): in an
IPython kernel, :func:`trim_memory` runs after every cell and returns the heap memory that freed
tensors leave behind to the operating system.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

_ENV = "TRITON_INTERPRET"
#: Set to 1 by ``llmu gpu-compile`` in the process that compiles every kernel for GPUs it does not have.
_COMPILE_ONLY_ENV = "LLMU_COMPILE_ONLY"
#: Set to 1 by the grading code (``llmu grade``, ``autograder/autograde``) for the kernels that run a
#: notebook being graded: benchmarks then time nothing (``llmu.bench.runner``), they earn no points.
AUTOGRADING_ENV = "LLMU_AUTOGRADING"

#: The value of TRITON_INTERPRET as the user left it (None when unset).
USER_SETTING: str | None = os.environ.get(_ENV)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip() not in ("", "0", "false", "False")


def _decide() -> str:
    """Pick the Triton mode and export it before triton is imported."""
    if _truthy(os.environ.get(_COMPILE_ONLY_ENV)):
        if _truthy(USER_SETTING):
            raise RuntimeError(f"{_COMPILE_ONLY_ENV}=1 compiles kernels for a GPU; it cannot run with {_ENV}=1")
        return "compile-only"
    if USER_SETTING is not None:
        return "interpreter" if USER_SETTING.strip() not in ("", "0", "false", "False") else "compiled"
    if _cuda_available():
        return "compiled"
    os.environ[_ENV] = "1"
    return "interpreter"


_MODE = _decide()
#: True when triton had already been imported before llmu could choose the mode.
TRITON_IMPORTED_EARLY = "triton" in sys.modules and USER_SETTING is None and _MODE == "interpreter"
#: How to get out of that state (``llmu doctor`` says it too).
TRITON_ORDER_FIX = "import llmu before triton (or set TRITON_INTERPRET=1 before starting Python)"


class TritonImportedEarly(RuntimeError):
    """A Triton kernel defined before llmu switched Triton to its interpreter was launched, on a
    machine without a GPU: ``@triton.jit`` built it for a GPU (it reads ``TRITON_INTERPRET`` when a
    kernel is defined), so it cannot run on CPU tensors. Kernels defined after ``import llmu``
    (llmu's own included) are interpreted and run."""


def _refuse_launches() -> None:
    """Make the launch of a kernel built for a GPU (a ``JITFunction``; interpreted kernels are
    another class) raise :class:`TritonImportedEarly`, which says what happened and what to do,
    instead of Triton's "0 active drivers" deep in the launch."""
    from triton.runtime.jit import JITFunction

    def refused(self, *args, **kwargs):
        name = getattr(getattr(self, "fn", None), "__name__", "a Triton kernel")
        raise TritonImportedEarly(
            f"{name} cannot run: it was defined before llmu switched Triton to its interpreter, on a machine "
            "without a GPU, so @triton.jit built it for a GPU. Run its cell again now that llmu is imported "
            f"(kernels defined after `import llmu` run on CPU tensors), or restart Python and {TRITON_ORDER_FIX}.")

    JITFunction.run = refused


if TRITON_IMPORTED_EARLY:
    _refuse_launches()


def triton_mode() -> str:
    """``"compiled"`` (kernels run on a GPU), ``"interpreter"`` (kernels run on CPU tensors) or
    ``"compile-only"`` (``llmu gpu-compile``: launchers choose their GPU configurations on CPU tensors,
    and each launch is compiled for a GPU target instead of run; see :mod:`llmu.gpu_compile`)."""
    return _MODE


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter."""
    return _MODE == "interpreter"


def device():
    """The torch device llmu uses by default: ``cuda`` when available, else ``cpu``."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kernel_device():
    """The device Triton kernels expect their tensors on (CPU in interpreter and compile-only mode)."""
    import torch

    return torch.device("cuda") if _MODE == "compiled" else torch.device("cpu")


#: The compute capability and streaming-multiprocessor count of the GPU ``llmu.gpu_compile`` is
#: compiling for, in compile-only mode.
_TARGET_CAPABILITY: tuple[int, int] | None = None
_TARGET_SM_COUNT: int | None = None


def capability() -> tuple[int, int] | None:
    """The kernel GPU's compute capability, e.g. ``(9, 0)`` for an H100/H200, ``(8, 0)`` for an
    A100, ``(7, 5)`` for a T4; in compile-only mode, the target being compiled for; ``None`` when
    kernels do not run on a GPU."""
    if _MODE == "compile-only":
        return _TARGET_CAPABILITY
    if _MODE == "compiled":
        import torch

        if torch.cuda.is_available():
            return tuple(torch.cuda.get_device_capability())
    return None


def sm_count() -> int | None:
    """Streaming multiprocessors of the kernel GPU (132 on an H100/H200 SXM, 108 on an A100, 40 on a
    T4): launchers size their grids with it. ``None`` when kernels do not run on a GPU."""
    if _MODE == "compile-only":
        return _TARGET_SM_COUNT
    if _MODE == "compiled":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return None


#: Shared memory one block may use (the opt-in maximum of CUDA's programming guide), by compute
#: capability: the figure for a GPU that is not at hand (``llmu gpu-compile`` compiles for it).
SHARED_MEMORY_PER_BLOCK = {(7, 0): 96 * 1024, (7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024,
                           (8, 7): 163 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024,
                           (12, 0): 99 * 1024}


def shared_memory_per_block() -> int | None:
    """Shared memory one block of a kernel may use on the kernel GPU, in bytes: the device's own
    figure on a GPU; in compile-only mode the table's for the target (48 KB, CUDA's portable limit,
    for a capability it does not list); ``None`` when kernels do not run on a GPU."""
    cap = capability()
    if cap is None:
        return None
    if _MODE == "compiled":
        import torch

        own = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "shared_memory_per_block_optin", None)
        if own:
            return int(own)
    return SHARED_MEMORY_PER_BLOCK.get(tuple(cap), 48 * 1024)


#: The first compute capability with bfloat16 arithmetic: 8.0 (Ampere, the A100; H100/H200 are 9.0).
BF16_CAPABILITY = (8, 0)


def supports_bf16(device=None) -> bool:
    """Whether kernels may compute in bfloat16 here: on CPU (interpreter) yes; on a GPU only from
    compute capability 8.0 (Ampere) on, the first with bf16 tensor cores. A T4 (7.5) has fp16 only.
    Given a torch ``device``, the answer for that device (a CUDA one by its own capability)."""
    if device is not None:
        import torch

        device = torch.device(device)
        return device.type != "cuda" or tuple(torch.cuda.get_device_capability(device)) >= BF16_CAPABILITY
    cap = capability()
    return cap is None or cap >= BF16_CAPABILITY


def _torch_device(where):
    import torch

    return torch.device(where) if where is not None else device()


def preferred_dtype(device=None):
    """The dtype to compute in on ``device`` (default: :func:`device`): float32 on a CPU; on a GPU
    bfloat16 from compute capability 8.0 on (A100, H100, H200), float16 below it (a T4, Colab's
    free GPU), whose hardware has no bf16 arithmetic."""
    import torch

    dev = _torch_device(device)
    if dev.type != "cuda":
        return torch.float32
    return torch.bfloat16 if supports_bf16(dev) else torch.float16


def half_dtype(device=None):
    """The 16-bit float type for ``device`` (default: :func:`device`): bfloat16 wherever it is
    supported (a CPU, a GPU from compute capability 8.0 on), float16 on older GPUs (a T4). For the
    cells that compare 2-byte weights with float32 ones on whatever machine the notebook runs."""
    import torch

    return torch.bfloat16 if supports_bf16(_torch_device(device)) else torch.float16


@dataclass(frozen=True)
class Environment:
    python: str
    torch: str
    triton: str | None
    device: str
    device_name: str
    triton_mode: str
    user_setting: str | None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def environment() -> Environment:
    """Versions, device and Triton mode, as recorded in benchmark results and `llmu doctor`."""
    import platform

    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - reported, not raised
        triton_version = None
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
    else:
        name = platform.processor() or platform.machine()
    return Environment(
        python=platform.python_version(),
        torch=torch.__version__,
        triton=triton_version,
        device=str(device()),
        device_name=name,
        triton_mode=_MODE,
        user_setting=USER_SETTING,
    )


# ---------------------------------------------------------------------------------------------
# CPU threads: as many as the process may use, not as many as the host has
# ---------------------------------------------------------------------------------------------

#: Where Linux shows control groups; a container's CPU quota is written there.
CGROUP_ROOT = "/sys/fs/cgroup"
#: This process's control group, one line per hierarchy ("0::/path" for cgroup v2).
PROC_SELF_CGROUP = "/proc/self/cgroup"
#: Thread settings of the user that :func:`configure_threads` never overrides.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


class CPUs(NamedTuple):
    """A number of CPUs (or threads) and where it came from, in words."""

    count: int
    source: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _ratio(quota: str, period: str) -> float | None:
    """``quota / period`` in CPUs; None for no limit ("max", -1) or anything unreadable."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _cgroup_dirs(base: Path, own: str | None) -> list[Path]:
    """``base/own`` and every folder above it up to ``base``: a parent's quota limits its children."""
    dirs = [base]
    if own and ".." not in Path(own.strip()).parts:
        d = base / own.strip().lstrip("/")
        while d != base and base in d.parents:
            dirs.insert(1, d)
            d = d.parent
    return dirs


def cgroup_cpu_quota(root: str | Path = CGROUP_ROOT, proc_cgroup: str | Path = PROC_SELF_CGROUP) -> CPUs | None:
    """This process's CPU quota from its control group, rounded up to whole CPUs, or None if none.

    cgroup v2 writes ``"QUOTA PERIOD"`` to ``cpu.max`` (``"max PERIOD"``: no limit); cgroup v1 has
    ``cpu/cpu.cfs_quota_us`` (-1: no limit) and ``cpu/cpu.cfs_period_us``. A quota of 150000 per
    100000 µs is 1.5 CPUs: the process may run 1.5 CPUs' worth of work each period, so 2 threads
    keep it busy (rounding up, as the Java and .NET runtimes do). The smallest quota of the
    process's group and the groups above it counts. Missing or unreadable files mean no quota:
    this never raises.
    """
    root = Path(root)
    own: dict[str, str] = {}  # "v2" or a v1 controller list -> the process's group path
    for line in (_read(Path(proc_cgroup)) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            own["v2" if parts[0] == "0" and parts[1] == "" else parts[1]] = parts[2]
    found: list[tuple[float, str]] = []
    for d in _cgroup_dirs(root, own.get("v2")):
        text = _read(d / "cpu.max")
        cpus = _ratio(*text.split()) if text is not None and len(text.split()) == 2 else None
        if cpus is not None:
            found.append((cpus, f"{d / 'cpu.max'}: {text}"))
    v1_own = next((path for ctrl, path in own.items() if "cpu" in ctrl.split(",")), None)
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for d in _cgroup_dirs(root / mount, v1_own):
            quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
            cpus = _ratio(quota, period) if quota is not None and period is not None else None
            if cpus is not None:
                found.append((cpus, f"{d}/cpu.cfs_quota_us {quota} per {period}"))
    if not found:
        return None
    cpus, where = min(found)
    return CPUs(max(1, math.ceil(cpus)), f"cgroup CPU quota {cpus:g} ({where})")


def available_cpus(root: str | Path = CGROUP_ROOT, proc_cgroup: str | Path = PROC_SELF_CGROUP) -> CPUs:
    """How many CPUs this process may really use, and why: the CPUs it may be scheduled on
    (its affinity, e.g. ``taskset`` or a container's cpuset), lowered to its cgroup CPU quota
    (:func:`cgroup_cpu_quota`) when that is smaller. At least 1; never raises."""
    try:
        cpus = CPUs(len(os.sched_getaffinity(0)), "CPU affinity")
    except (AttributeError, OSError):  # not Linux
        cpus = CPUs(os.cpu_count() or 1, "os.cpu_count()")
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if quota is not None and quota.count < cpus.count:
        return CPUs(quota.count, f"{quota.source}, of {cpus.count} CPUs by {cpus.source}")
    return CPUs(max(1, cpus.count), cpus.source)


_THREADS: CPUs | None = None


def configure_threads(root: str | Path = CGROUP_ROOT, proc_cgroup: str | Path = PROC_SELF_CGROUP) -> CPUs:
    """Give torch no more CPU threads than :func:`available_cpus`; return the count and why.

    torch starts one thread per core of the *host*. In a container limited to 2 CPUs on a 16-core
    host, 16 threads then take turns on 2 CPUs and every matrix product waits for the slowest of
    them: generation runs several times slower than with one thread. This lowers the count (it
    never raises it: torch's own default and a smaller ``torch.set_num_threads`` stay).

    The user's setting wins: with ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` in the environment
    nothing is changed. (A ``torch.set_num_threads(n)`` with ``n`` above the CPUs available,
    called before the first model load, cannot be told from torch's default and is lowered: set
    the environment variable instead.) Runs once per process; later calls return the first
    answer and change nothing. ``llmu chat``, ``doctor`` and ``bench`` and
    :func:`llmu.models.load_model` call it.
    """
    global _THREADS
    if _THREADS is not None:
        return _THREADS
    import torch

    for var in THREAD_ENV_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            _THREADS = CPUs(torch.get_num_threads(), f"{var}={value} set by you")
            return _THREADS
    cpus = available_cpus(root, proc_cgroup)
    current = torch.get_num_threads()
    if current > cpus.count:
        torch.set_num_threads(cpus.count)
        _THREADS = CPUs(cpus.count, f"{cpus.source}; torch had {current}")
    elif current == cpus.count:
        _THREADS = cpus
    else:
        _THREADS = CPUs(current, f"torch's setting, below the {cpus.count} CPUs of {cpus.source}")
    return _THREADS


# ---------------------------------------------------------------------------------------------
# Memory: give freed memory back after each notebook cell
# ---------------------------------------------------------------------------------------------

def trim_memory() -> bool:
    """Return the heap memory Python and torch have freed to the operating system (glibc only).

    glibc's ``malloc`` keeps freed blocks for reuse instead of unmapping them, and a cell that
    builds and drops a quantized model or a window of logits leaves hundreds of MB of such blocks:
    the process still *counts* them (its resident memory), which is what a 2 GB Binder or Colab
    limit measures. ``malloc_trim(0)`` hands every whole free page back. Returns whether it ran.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to do
        return False
    trim(0)
    return True


_TRIM_HOOKED = False


def _hook_trim_after_cells() -> None:
    """In an IPython kernel, run :func:`trim_memory` after every cell (a few milliseconds)."""
    global _TRIM_HOOKED
    if _TRIM_HOOKED:
        return
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    if shell is None or not hasattr(shell, "events"):
        return
    shell.events.register("post_run_cell", lambda *_: trim_memory())
    _TRIM_HOOKED = True


_hook_trim_after_cells()
