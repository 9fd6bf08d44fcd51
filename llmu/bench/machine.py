"""This machine's speed, measured the same way wherever llmu needs it: the best rate of a
repeated operation, torch's threads for a block, and the copy bandwidth that bounds decoding.

:func:`llmu.roofline.measure_machine` (module 05's roofline) and the decode benchmark's memory
roof (:func:`llmu.models.bench.decode_roof`) both use these, so the two figures are one
measurement. ``llmu.roofline.measure``'s docstring gives the methodology.
"""

from __future__ import annotations

import time

import torch

__all__ = ["Threads", "best_rate", "copy_bandwidth", "sync"]


def sync(device: torch.device) -> None:
    """Wait for ``device`` to finish its queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Threads:
    """Set torch's CPU threads for a block and restore them after (``None``: leave them)."""

    def __init__(self, threads: int | None):
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")
        self.threads = threads

    def __enter__(self):
        self.previous = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)

    def __exit__(self, *exc):
        torch.set_num_threads(self.previous)


def best_rate(fn, work: float, device: torch.device, budget_s: float, min_runs: int = 3) -> tuple[float, int]:
    """Run ``fn`` until ``budget_s`` is spent (at least ``min_runs`` times after a warm-up) and
    return the best ``work / seconds`` and the number of timed runs. The best, not the median:
    on a shared machine every disturbance makes a run slower, never faster."""
    fn()
    sync(device)
    best, runs, started = 0.0, 0, time.perf_counter()
    while runs < min_runs or time.perf_counter() - started < budget_s:
        t0 = time.perf_counter()
        fn()
        sync(device)
        elapsed = time.perf_counter() - t0
        best = max(best, work / max(elapsed, 1e-9))
        runs += 1
        if runs >= 1000:
            break
    return best, runs


def copy_bandwidth(device=None, copy_mb: int = 128, budget_s: float = 1.0) -> tuple[float, int, int]:
    """Bytes per second of ``dst.copy_(src)`` over ``copy_mb`` MiB buffers on ``device`` (CPU by
    default), counting what it moves: every byte read and every byte written. Returns
    ``(bytes_per_s, timed_runs, buffer_bytes)``."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if isinstance(copy_mb, bool) or not isinstance(copy_mb, int) or copy_mb < 1:
        raise ValueError(f"copy_mb must be an int >= 1 (MiB), got {copy_mb!r}")
    n_elem = copy_mb * 2**20 // 4
    src = torch.ones(n_elem, device=device, dtype=torch.float32)  # written once: pages are real
    dst = torch.zeros_like(src)
    nbytes = src.numel() * src.element_size()
    rate, runs = best_rate(lambda: dst.copy_(src), 2.0 * nbytes, device, budget_s)
    return rate, runs, nbytes
