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

#: The value of TRITON_INTERPRET as the user left it (None when unset).
USER_SETTING: str | None = os.environ.get(_ENV)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


def _decide() -> str:
    """Pick the Triton mode and export it before triton is imported."""
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
    """``"compiled"`` (kernels run on a GPU) or ``"interpreter"`` (kernels run on CPU tensors)."""
    return _MODE


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter."""
    return _MODE == "interpreter"


def device():
    """The torch device llmu uses by default: ``cuda`` when available, else ``cpu``."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kernel_device():
    """The device Triton kernels expect their tensors on (CPU in interpreter mode)."""
    import torch

    return torch.device("cpu") if interpreting() else torch.device("cuda")


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
