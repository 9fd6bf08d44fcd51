"""Benchmark entries of module 14: the bus bandwidth of an all-reduce, and the measured pipeline bubble.

``all_reduce`` (a ``run=`` entry: it starts its own processes). ``p`` ranks are started with
``llmu.distributed.launch``: gloo processes on a CPU, one NCCL process per GPU on a machine with
two GPUs or more (all of them, up to 8). Each rank all-reduces (SUM) a float32 tensor of ``bytes``
bytes, for message sizes growing by 4x; after two warm-up calls (the first checked: a sum of
ones must give ``p`` everywhere), every timed call starts after a
barrier and its time is the slowest rank's (a ``MAX`` all-reduce of the ranks' times, outside the
timed region). The row reports the median time and, as nccl-tests does, the **bus bandwidth**

    busbw = (bytes / t) · 2(p - 1)/p

in the ``gbs`` column: the bytes each rank's link carried per second in a ring all-reduce,
comparable with the link's bandwidth per direction (``llmu.parallel.comm``). Small messages
measure the latency ``α`` (the bus bandwidth is low), large ones the bandwidth ``β``; the notebook
fits the α–β model to these rows with ``llmu.parallel.comm.fit_alpha_beta``.

On a CPU, gloo moves the bytes through the loopback interface and main memory, and picks its own
all-reduce algorithm: the figures describe this machine, not a GPU network. A machine with one
GPU cannot run the NCCL case; the entry then records a skipped row.

``pipeline_bubble`` (a ``run=`` entry, gloo processes on the CPU). For each world size ``p``, one
``launch`` (starting processes costs seconds, so not one per case) in which every rank runs
``llmu.parallel.pipeline_parallel.demo`` for each schedule (GPipe, 1F1B) and micro-batch count
``m``: one pipelined training step of a tiny Llama, one layer per stage, after a warm-up step,
each ``F`` padded to ``forward_s`` (20 ms) and each ``B`` to twice that (the calibrated costs of
that module's docstring). One row per (schedule, p, m):

* ``bubble``: the measured idle fraction ``1 - busy / makespan``, the mean over the ranks;
  ``bubble_max`` the largest, ``bubble_ranks`` each rank's (as it reported it) and ``busy_s`` each
  rank's seconds in ``F`` and ``B``, recomputed from its timeline;
* ``bubble_theory``: ``(p - 1) / (m + p - 1)``, and ``bubble_diff = bubble - bubble_theory``;
* ``makespan_s`` (``ms`` in milliseconds) and ``makespan_ideal_s = (m + p - 1)(t_f + t_b)``, what
  equal costs and free messages would take;
* ``load_avg_start``, ``load_avg_end``: the machine's 1-minute load average around the step
  (``llmu.bench.paired.load_average``); ``grad_error``: the largest gradient error against one
  process (a row whose gradients are wrong is an error, not a figure).

The fixed costs of every action and message (Python, gloo, a process waking up) lengthen the
makespan, so the measured bubble lies above the formula, by more on a busier machine: read
``bubble_diff`` beside the load average. The tests check that the rows are consistent, never the
measured value. Each step sleeps most of its time, so ``p = 4`` runs on 2 cores.

On a CUDA device the entry records a skipped row: its processes are gloo processes on the host
CPU whose sleeps stand in for GPU work, so a GPU run would measure the host, not the GPU, under
the GPU's name. Run it with ``--device cpu`` (``--sizes cpu`` on a machine without a GPU).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from llmu.bench.paired import load_average
from llmu.bench.registry import Entry, register
from llmu.parallel import pipeline_parallel as PP
from llmu.parallel.comm import bus_bandwidth

__all__ = ["ALL_REDUCE", "CPU_BYTES", "GPU_BYTES", "measure_all_reduce", "all_reduce_rows", "PIPELINE_BUBBLE",
           "PIPELINE_CPU_SIZES", "measure_pipeline", "pipeline_bubble_rows"]

MODULE = "14_parallelism"

#: Message sizes in bytes: 4 KiB to 16 MiB on a CPU, 1 MiB to 4 GiB on GPUs (each 4x the last).
CPU_BYTES = [4 ** k * 1024 for k in range(1, 8)]
GPU_BYTES = [4 ** k * 2 ** 20 for k in range(0, 7)] + [2 ** 32]


def measure_all_reduce(rank: int, world_size: int, sizes: list[int], repeats: int = 5) -> list[dict]:
    """Rank function: the median time of an all-reduce of each size in ``sizes`` (bytes, multiples
    of 4), the slowest rank's per call. Run it with ``launch(measure_all_reduce, p, sizes)``."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    warm = torch.ones(1024, dtype=torch.float32, device=device)
    for _ in range(5):                  # the first calls set up the connections between the ranks
        dist.all_reduce(warm)
    out = []
    for n_bytes in sizes:
        x = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(x)              # a sum of ones: every element must now be world_size
        if not bool((x == world_size).all()):
            raise RuntimeError(f"all-reduce of {n_bytes} bytes: expected every element to be {world_size}")
        dist.all_reduce(x)
        sync()
        samples = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            sync()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            samples.append(elapsed.item())
        out.append({"bytes": n_bytes, "seconds": statistics.median(samples), "min_s": min(samples),
                     "max_s": max(samples), "n_samples": len(samples)})
        del x
    return out


def all_reduce_rows(size: dict, device) -> list[dict]:
    """The ``run=`` function of the entry: one launch, one row per message size."""
    from llmu.distributed import launch

    device = torch.device(device)
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        if gpus < 2:
            return [{"status": "skipped", "provider": "nccl", "kind": "builtin",
                     "reason": f"an all-reduce over NCCL needs 2 GPUs or more; {gpus} visible"}]
        world, backend, sizes = min(gpus, 8), "nccl", size.get("bytes_list", GPU_BYTES)
    else:
        world, backend, sizes = size.get("p", 2), "gloo", size.get("bytes_list", CPU_BYTES)
    measured = launch(measure_all_reduce, world, list(sizes), size.get("repeats", 5), backend=backend)[0]
    rows = []
    for m in measured:
        n, t = m["bytes"], m["seconds"]
        rows.append({
            "provider": backend, "label": f"all-reduce, {backend}, {world} ranks", "kind": "builtin",
            "size": {"p": world, "bytes": n}, "size_label": f"p={world} bytes={n}", "x": n, "x_key": "bytes",
            "dtype": "float32", "device": str(device), "ms": t * 1e3, "ms_min": m["min_s"] * 1e3,
            "ms_max": m["max_s"] * 1e3, "n_samples": m["n_samples"], "bytes": float(n),
            "gbs": bus_bandwidth(n, t, world) / 1e9,
        })
    return rows


ALL_REDUCE = register(Entry(
    name="all_reduce",
    module=MODULE,
    description="all-reduce (SUM, float32) over p ranks: time and nccl-tests' bus bandwidth (gbs column) "
                "against the message size",
    run=all_reduce_rows,
    cpu_sizes=[{"p": 2}],
    gpu_sizes=[{}],
    x_axis="bytes",
))


# ----------------------------------------------------------------------------------------------
# pipeline_bubble
# ----------------------------------------------------------------------------------------------

#: One launch per size: ``p`` ranks, every schedule, each micro-batch count of ``micro_batches``.
PIPELINE_CPU_SIZES = [{"p": 2, "micro_batches": [1, 4, 8]}, {"p": 4, "micro_batches": [1, 4, 8]}]
#: The calibrated cost of an ``F`` in seconds (a ``B`` costs twice that), as ``demo`` has it.
PIPELINE_FORWARD_S = 0.02
#: Above this relative gradient error the pipeline computed something else: the row is an error.
PIPELINE_GRAD_RTOL = 1e-4


def measure_pipeline(rank: int, world_size: int, schedules: list[str], micro_batches: list[int],
                     forward_s: float) -> list[dict]:
    """Rank function: ``demo`` for every schedule and micro-batch count, in that order, each with
    the load average before and after it. Run it with ``launch(measure_pipeline, p, ...)``."""
    out = []
    for schedule in schedules:
        for m in micro_batches:
            start = load_average()
            result = PP.demo(rank, world_size, schedule, m, forward_s)
            out.append({**result, "load_avg_start": start, "load_avg_end": load_average()})
    return out


def _pipeline_size(size: dict) -> tuple[int, list[str], list[int], float]:
    """``(p, schedules, micro_batches, forward_s)`` of a size dict; ValueError naming a bad key."""
    p = size.get("p", 2)
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"size['p'] must be an int >= 1 (the number of stages), got {p!r}")
    schedules = list(size.get("schedules", PP.SCHEDULES))
    if not schedules or any(s not in PP.SCHEDULES for s in schedules):
        raise ValueError(f"size['schedules'] must name some of {PP.SCHEDULES}, got {schedules!r}")
    micro_batches = list(size.get("micro_batches", [1, 4, 8]))
    if not micro_batches or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in micro_batches):
        raise ValueError(f"size['micro_batches'] must be a list of ints >= 1, got {micro_batches!r}")
    forward_s = size.get("forward_s", PIPELINE_FORWARD_S)
    if isinstance(forward_s, bool) or not isinstance(forward_s, (int, float)) or not 0 < forward_s <= 1:
        raise ValueError(f"size['forward_s'] must be a number of seconds in (0, 1], got {forward_s!r}")
    return p, schedules, micro_batches, float(forward_s)


def pipeline_bubble_rows(size: dict, device) -> list[dict]:
    """The ``run=`` function of ``pipeline_bubble``: one launch of ``size["p"]`` gloo ranks, one row
    per (schedule, micro-batch count). ``size`` keys: ``p``, ``micro_batches`` (a list),
    ``schedules`` (default both), ``forward_s`` (default 20 ms)."""
    from llmu.distributed import launch

    if torch.device(device).type == "cuda":
        return [{"status": "skipped", "provider": "gloo", "kind": "torch",
                 "reason": "the pipeline runs as gloo processes on the host CPU, sleeps standing in for GPU work: "
                           "it measures the host, not the GPU; run it with --device cpu"}]
    p, schedules, micro_batches, forward_s = _pipeline_size(size)
    per_rank = launch(measure_pipeline, p, schedules, micro_batches, forward_s)
    rows = []
    for k, first in enumerate(per_rank[0]):
        ranks = [results[k] for results in per_rank]
        schedule, m = first["schedule"], first["micro_batches"]
        busy = [sum(e.end - e.start for e in r["timeline"] if e.op in PP.COMPUTE_OPS) for r in ranks]
        bubbles = [r["bubble"] for r in ranks]
        bubble, theory = sum(bubbles) / p, PP.theoretical_bubble(p, m)
        makespan, backward_s = first["makespan_s"], 2 * forward_s
        grad_error = max(r["grad_error"] for r in ranks)
        row = {
            "provider": schedule, "label": f"{schedule} on {p} gloo ranks", "kind": "torch",
            "size": {"p": p, "m": m}, "size_label": f"p={p} m={m}", "x": m, "x_key": "m",
            "dtype": "float32", "device": "cpu", "ms": makespan * 1e3, "n_samples": 1,
            "makespan_s": makespan, "makespan_ideal_s": (m + p - 1) * (forward_s + backward_s),
            "forward_s": forward_s, "backward_s": backward_s,
            "bubble": bubble, "bubble_max": max(bubbles), "bubble_ranks": bubbles, "busy_s": busy,
            "bubble_theory": theory, "bubble_diff": bubble - theory, "grad_error": grad_error,
            "load_avg_start": first["load_avg_start"], "load_avg_end": first["load_avg_end"],
            # `llmu bench` prints an ok row's reason as its note: the figures to read
            "reason": f"bubble {bubble:.3f} (max {max(bubbles):.3f}), theory {theory:.3f}, "
                      f"{bubble - theory:+.3f}",
        }
        if not grad_error <= PIPELINE_GRAD_RTOL:
            row.update(status="error", reason=f"pipelined gradients differ from one process by {grad_error:.1e} "
                                              f"(relative), above {PIPELINE_GRAD_RTOL:g}")
        rows.append(row)
    return rows


PIPELINE_BUBBLE = register(Entry(
    name="pipeline_bubble",
    module=MODULE,
    description="measured pipeline bubble of GPipe and 1F1B (gloo ranks, calibrated 20/40 ms per F/B) against "
                "(p - 1)/(m + p - 1), with the load average",
    run=pipeline_bubble_rows,
    cpu_sizes=PIPELINE_CPU_SIZES,
    gpu_sizes=[{}],
    x_axis="m",
))
