"""Every Triton kernel of llmu, compiled for real GPUs on a machine without one.

    llmu gpu-compile                       # all kernels, for sm_90 (H100/H200), sm_80 (A100), sm_75 (T4)
    llmu gpu-compile --targets sm_75 -k flash --json rows.json

Triton compiles ahead of time for a named architecture: the kernel is lowered to PTX and
assembled to a cubin by the ``ptxas`` that ships in Triton's wheel, without a driver or a GPU.
This package calls every launcher of the course (:mod:`llmu.gpu_compile.cases`) in a process where
launches are compiled instead of run (:mod:`llmu.gpu_compile.capture`), so each kernel is built with
the very configuration its launcher picks on a GPU, for every dtype it accepts, and checks what a
GPU would refuse: shared memory over the architecture's limit. It prints one row per kernel ×
configuration × target with the shared memory, registers and spills ``ptxas`` reports.

It fails (exit 1) when a compile fails, a kernel needs more shared memory than a target has, a
launcher refuses an input for a reason other than "bf16 needs sm_80" on a T4, a kernel of llmu is
reached by no case, or a case leaves out a dtype its launcher accepts.

The work runs in a child process (``LLMU_COMPILE_ONLY=1`` must be set before llmu and Triton are
imported, see :mod:`llmu.runtime`); :func:`run` starts it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from llmu.cache import cache_dir

__all__ = ["run", "TARGET_NAMES"]

TARGET_NAMES = ("sm_90", "sm_80", "sm_75")


#: Where compiled kernels are kept between runs: ``gpu-compile/`` in llmu's cache folder
#: (:func:`llmu.cache.cache_dir`), unless ``LLMU_GPU_COMPILE_CACHE`` names another.
CACHE_DIR = os.environ.get("LLMU_GPU_COMPILE_CACHE", str(cache_dir("gpu-compile")))


def run(targets: Sequence[str] = TARGET_NAMES, only: str | None = None, json_path: str | None = None,
        quiet: bool = False, cache_dir: str = CACHE_DIR, record: str | None = None,
        write_record: str | None = None) -> int:
    """Run the check in a fresh compile-only process; return its exit status (0: all good).
    ``record``/``write_record``: see ``--record``/``--write-record`` of ``llmu gpu-compile``."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["LLMU_COMPILE_ONLY"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""   # a real GPU, if any, must not change what is compiled
    # A Triton cache of its own, beside which capture.py keeps what ptxas reported for each kernel
    # (a kernel served from the cache skips ptxas): a second run only recompiles what changed.
    env["TRITON_CACHE_DIR"] = cache_dir
    os.makedirs(cache_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "llmu.gpu_compile", "--targets", ",".join(targets)]
    if only:
        cmd += ["-k", only]
    if json_path:
        cmd += ["--json", os.path.abspath(json_path)]
    if quiet:
        cmd += ["--quiet"]
    if record:
        cmd += ["--record", os.path.abspath(record)]
    if write_record:
        cmd += ["--write-record", os.path.abspath(write_record)]
    return subprocess.call(cmd, env=env)
