"""Benchmark entry of module 14: the bus bandwidth of an all-reduce, over the message size.

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
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from llmu.bench.registry import Entry, register
from llmu.parallel.comm import bus_bandwidth

__all__ = ["ALL_REDUCE", "CPU_BYTES", "GPU_BYTES", "measure_all_reduce", "all_reduce_rows"]

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
