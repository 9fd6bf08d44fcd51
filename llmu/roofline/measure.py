"""Measurements: this machine's roofs, a GEMV at several dtypes, and TTFT / TPOT / TTLT.

``measure_machine`` methodology (bounded to ``budget_s`` seconds, about half for each roof):

* **Peak FLOP/s**: a square matmul ``n x n @ n x n`` (``n = 1024`` by default; 2 n^3 FLOPs), run
  repeatedly; the *best* rate is kept, because on a shared machine every disturbance makes a run
  slower, never faster. It is the peak *a matmul reaches here*, with this library (oneDNN / MKL on
  a CPU, cuBLAS on a GPU), in ``dtype`` (fp32 by default), using the threads torch has.
* **Bandwidth**: ``dst.copy_(src)`` of a buffer of ``copy_mb`` MiB (128 by default, several
  times the last-level cache of a laptop or server CPU, so the copy goes to memory and back).
  A copy reads every byte of ``src`` and writes every byte of ``dst``: it moves ``2 x`` the buffer
  size, and that is what is counted. (Some CPUs also read ``dst`` before writing it, a
  "write-allocate"; that traffic is not counted, so the figure is what a program can use.)
  Best run kept, as for the FLOP/s.

Latency of generation, for one request of ``T`` prompt tokens and ``n`` new tokens, with ``t0``
the moment the request starts and ``t_1 .. t_n`` the moments the tokens come out:

* **TTFT** (time to first token) ``= t_1 - t0``: the prefill of the ``T`` prompt tokens plus the
  first sampling;
* **TPOT** (time per output token) ``= (t_n - t_1) / (n - 1)``: the mean gap between tokens, one
  decode step each;
* **TTLT** (time to last token) ``= t_n - t0 = TTFT + (n - 1) TPOT``.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from llmu.bench.machine import Threads, best_rate, copy_bandwidth
from llmu.roofline.model import Roof

__all__ = ["MachineRoof", "measure_machine", "TokenLatency", "token_latency", "latency_metrics",
           "gemv_sweep", "model_weight_bytes"]


@dataclass(frozen=True)
class MachineRoof:
    """What :func:`measure_machine` found (FLOP/s and bytes/s) and how."""

    name: str
    peak_flops: float
    bandwidth: float
    dtype: str
    matmul_n: int
    copy_bytes: int
    threads: int
    seconds: float
    runs_matmul: int
    runs_copy: int

    @property
    def ridge(self) -> float:
        return self.peak_flops / self.bandwidth

    def roof(self) -> Roof:
        """This machine as a :class:`Roof` (source ``"measured"``)."""
        return Roof(self.name, self.peak_flops, self.bandwidth, self.dtype, "measured")

    def as_dict(self) -> dict:
        return dict(asdict(self), ridge=self.ridge)

    def __str__(self) -> str:
        return (f"{self.name}: {self.peak_flops / 1e9:.1f} GFLOP/s ({self.dtype} matmul n={self.matmul_n}), "
                f"{self.bandwidth / 1e9:.1f} GB/s (copy of {self.copy_bytes / 2**20:.0f} MiB), "
                f"ridge {self.ridge:.1f} FLOP/byte, {self.threads} thread(s), {self.seconds:.1f} s")


def _machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
            else:
                cpu = "CPU"
    except OSError:
        import platform

        cpu = platform.processor() or "CPU"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return f"this machine ({cpu}, {cores} cores)"


def measure_machine(device=None, dtype=torch.float32, budget_s: float = 3.0, matmul_n: int = 1024,
                    copy_mb: int = 128, threads: int | None = None) -> MachineRoof:
    """Measure this machine's peak matmul FLOP/s and copy bandwidth in about ``budget_s`` seconds.

    See the module docstring for the methodology. ``device``: ``"cpu"`` by default (a CUDA
    device works too, timed with synchronisation). ``threads``: torch CPU threads for the
    measurement (restored after; default: as the process has them).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 < budget_s <= 60:
        raise ValueError(f"budget_s must be in (0, 60] seconds, got {budget_s!r}")
    if isinstance(matmul_n, bool) or not isinstance(matmul_n, int) or matmul_n < 16:
        raise ValueError(f"matmul_n must be an int >= 16, got {matmul_n!r}")
    if isinstance(copy_mb, bool) or not isinstance(copy_mb, int) or copy_mb < 1:
        raise ValueError(f"copy_mb must be an int >= 1 (MiB), got {copy_mb!r}")
    started = time.perf_counter()
    with Threads(threads):
        g = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(matmul_n, matmul_n, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(matmul_n, matmul_n, generator=g).to(device=device, dtype=dtype)
        out = torch.empty(matmul_n, matmul_n, device=device, dtype=dtype)
        flops, runs_mm = best_rate(functools.partial(torch.matmul, a, b, out=out), 2.0 * matmul_n**3, device, budget_s / 2)
        del a, b, out
        bandwidth, runs_copy, copy_bytes = copy_bandwidth(device, copy_mb, budget_s / 2)
        used_threads = torch.get_num_threads()
    from llmu.bench.peaks import dtype_name

    return MachineRoof(_machine_name(device), flops, bandwidth, dtype_name(dtype), matmul_n, copy_bytes,
                       used_threads, time.perf_counter() - started, runs_mm, runs_copy)


# ---------------------------------------------------------------------------------------------
# GEMV at several dtypes: time follows bytes
# ---------------------------------------------------------------------------------------------

def gemv_sweep(shapes: Sequence[tuple[int, int]] = ((2048, 2048), (4096, 4096), (8192, 4096)),
               dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16), batch: int = 1,
               device=None, budget_s: float = 0.3, threads: int | None = None) -> list[dict]:
    """Time ``x (batch x K) @ W^T`` for ``W`` of each ``(N, K)`` in ``shapes`` and each dtype.

    One row per (shape, dtype): ``N``, ``K``, ``dtype``, ``weight_bytes`` (``N K elem``), ``bytes``
    (weights + input + output), ``flops``, ``ms`` (the best of the runs in ``budget_s``), ``gbs``
    and ``gflops``. If time follows bytes, halving the element size halves ``ms``.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    rows = []
    with Threads(threads):
        for n, k in shapes:
            for dtype in dtypes:
                g = torch.Generator(device="cpu").manual_seed(0)
                w = torch.randn(n, k, generator=g).to(device=device, dtype=dtype)
                x = torch.randn(batch, k, generator=g).to(device=device, dtype=dtype)
                elem = w.element_size()
                flops = 2.0 * batch * n * k
                nbytes = float(elem * (n * k + batch * k + batch * n))
                rate, _ = best_rate(functools.partial(torch.nn.functional.linear, x, w), 1.0, device, budget_s)
                ms = 1e3 / rate
                rows.append(dict(N=n, K=k, batch=batch, dtype=str(dtype).removeprefix("torch."),
                                 elem_bytes=elem, weight_bytes=n * k * elem, bytes=nbytes, flops=flops,
                                 ms=ms, gbs=nbytes / (ms * 1e-3) / 1e9, gflops=flops / (ms * 1e-3) / 1e9))
                del w, x
    return rows


def model_weight_bytes(model) -> int:
    """Bytes of every parameter of ``model`` (a tied matrix is counted once): what one decode
    step reads."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


# ---------------------------------------------------------------------------------------------
# TTFT, TPOT, TTLT
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenLatency:
    """Latency of one generation, in seconds (see the module docstring)."""

    ttft: float
    tpot: float  # mean gap between tokens; nan with a single token
    ttlt: float
    n_tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def token_latency(start: float, timestamps: Sequence[float]) -> TokenLatency:
    """TTFT, TPOT and TTLT from the request's ``start`` time and the times the tokens came out.

    ``timestamps`` must be non-empty, non-decreasing and not before ``start`` (any clock, in
    seconds: ``time.perf_counter()`` values, say). With one token TPOT is undefined (nan).
    """
    times = [float(t) for t in timestamps]
    if not times:
        raise ValueError("timestamps is empty: at least one token must have been produced")
    start = float(start)
    if not all(math.isfinite(t) for t in times + [start]):
        raise ValueError("start and timestamps must be finite")
    if times[0] < start:
        raise ValueError(f"timestamps: the first token ({times[0]}) comes before start ({start})")
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError("timestamps must be non-decreasing")
    n = len(times)
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else float("nan")
    return TokenLatency(ttft=times[0] - start, tpot=tpot, ttlt=times[-1] - start, n_tokens=n)


def _random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (length,), generator=g).tolist()


def latency_metrics(model, prompt_lens: Sequence[int] = (16, 64, 256), new_tokens: int = 16, *,
                    repeats: int = 1, seed: int = 0, warmup: bool = True,
                    threads: int | None = None) -> list[dict]:
    """TTFT, TPOT and TTLT of ``model`` (an ``llmu.models.LlamaModel``) for each prompt length.

    Each request is a prompt of random token ids (ids 100 and up; the content does not change
    the cost) and exactly ``new_tokens`` greedy tokens (EOS ignored), through
    ``llmu.models.generate_ids``, the loop ``generate`` uses (prefill, then one decode step per
    token, with the contiguous KV cache). The time of each token is taken as it comes out of the
    generator. With ``repeats > 1`` the run with the median TTLT is kept.

    Returns one dict per prompt length: ``prompt_len``, ``new_tokens``, ``ttft_s``, ``tpot_s``
    (mean gap), ``ttlt_s``, ``gap_median_s``, ``gap_min_s``, ``gap_max_s``, and from
    :class:`llmu.models.GenerationStats` ``prefill_s`` (the prompt's forward pass alone),
    ``decode_s`` (the decode steps and sampling) and ``decode_path`` (``"decode_step"`` or
    ``"modules"``: see ``llmu.models.decode_step``).
    """
    from llmu.models.generate import GenerationStats, generate_ids

    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens must be an int >= 2 (TPOT needs two tokens), got {new_tokens!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    lens = list(prompt_lens)
    if not lens:
        raise ValueError("prompt_lens is empty")
    limit = model.config.max_position_embeddings
    for p in lens:
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"prompt_lens: each length must be an int >= 1, got {p!r}")
        if p + new_tokens > limit:
            raise ValueError(f"prompt_lens: {p} + new_tokens {new_tokens} exceeds the model's context of {limit}")

    def one(ids: list[int]) -> dict:
        stats = GenerationStats()
        times = []
        start = time.perf_counter()
        for _ in generate_ids(model, ids, new_tokens, stats=stats):
            times.append(time.perf_counter())
        lat = token_latency(start, times)
        gaps = [b - a for a, b in zip(times, times[1:])]
        return dict(prompt_len=len(ids), new_tokens=lat.n_tokens, ttft_s=lat.ttft, tpot_s=lat.tpot,
                    ttlt_s=lat.ttlt, gap_median_s=statistics.median(gaps), gap_min_s=min(gaps),
                    gap_max_s=max(gaps), prefill_s=stats.prefill_s, decode_s=stats.decode_s,
                    decode_path=stats.decode_path)

    rows = []
    with Threads(threads):
        if warmup:  # the first forward passes allocate and choose kernels
            for _ in generate_ids(model, _random_prompt(model.config.vocab_size, min(lens), seed), 2):
                pass
        for p in lens:
            ids = _random_prompt(model.config.vocab_size, p, seed)
            runs = sorted((one(ids) for _ in range(repeats)), key=lambda r: r["ttlt_s"])
            rows.append(runs[len(runs) // 2])
    return rows
