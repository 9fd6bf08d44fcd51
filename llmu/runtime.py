"""Where llmu's code runs: the torch device and the Triton mode.

Triton kernels compile to GPU code when a CUDA device is present. Without one, Triton's
interpreter runs the very same ``@triton.jit`` functions on CPU tensors (through numpy), which is
how every kernel of the course can be written, graded and tested on a laptop or a Binder.

The interpreter is switched on by the environment variable ``TRITON_INTERPRET=1``, and Triton reads
it when a kernel is *defined*. This module therefore sets it before anything in llmu imports
triton: ``import llmu`` imports this module first. A value the user set is always respected.

It also keeps notebooks inside small memory limits (Binder and Colab give 2 GB or so): in an
IPython kernel, :func:`trim_memory` runs after every cell and returns the heap memory that freed
tensors leave behind to the operating system.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

_ENV = "TRITON_INTERPRET"
#: Set to 1 by ``llmu gpu-compile`` in the process that compiles every kernel for GPUs it does not have.
_COMPILE_ONLY_ENV = "LLMU_COMPILE_ONLY"

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
