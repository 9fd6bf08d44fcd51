"""Data parallelism (llmu.parallel.data_parallel) against the single process, on real gloo processes.

Spawning a process group costs seconds, so each world size runs every case inside ONE ``launch``;
the rank function returns a dict of errors and the tests assert on them.

Every rank trains a tiny Llama on its shard of a fixed global batch of 8 sequences (8/W each), and
a single-process copy on the whole batch; both take the same AdamW steps.

Tolerances, float32:
- gradients after :meth:`finish`, relative to the largest gradient: ``1e-6``. The single process
  sums the batch's contributions in one order, the ranks per shard and then across ranks (divided
  by W = 2 or 4, exact in binary floating point): a few float32 roundings (6e-8 relative each).
- parameters after each of 3 steps, absolute: ``3e-6``. AdamW's step is nearly scale-free
  (``lr * m / sqrt(v)``), so a gradient that differs in its last bits changes an update of size
  ``lr = 1e-2`` in its last bits, and the sum ``p - update`` may round to the neighbouring float:
  one ulp of a parameter near 1-2 (a norm gain) is 1.2e-7-2.4e-7, per step. 3e-6 is about 12 such
  ulps over 3 steps; the largest error seen is 4.6e-7.
AdamW's scale-freedom is also why the gradients are checked on their own: an all-reduce that
forgot to divide by W would move the parameters by almost nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import llmu  # noqa: F401  (sets the Triton mode before anything imports triton)
from llmu.distributed import launch
from llmu.models import tiny_llama
from llmu.parallel.data_parallel import DataParallel, demo, next_token_loss, single_process_steps

GRAD_RTOL = 1e-6
PARAM_ATOL = 3e-6
STEPS, LR, BATCH, SEQ = 3, 1e-2, 8, 17
BUCKETS_MB = {"per_param": 1e-6, "medium": 0.05, "one_bucket": 25.0}   # 1e-6 MiB = 1 byte


def _model():
    return tiny_llama(0).train().requires_grad_(True)


def _batch():
    return torch.randint(97, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _rel(a, b):
    return ((a - b).abs().max() / max(b.abs().max().item(), 1e-30)).item()


def _reference():
    """The single process on the whole batch: gradients of step 1, parameters after each step."""
    return single_process_steps(_model(), _batch(), STEPS, LR)


def _train(rank, world, reference, bucket_mb, micro_batches=1):
    """DP training on this rank's shard: errors per step, the final parameters, the buckets."""
    ref_grads, ref_params = reference
    shard = _batch().chunk(world)[rank]
    model = _model()
    with torch.no_grad():                     # rank 0's weights must win the broadcast
        for p in model.parameters():
            p.add_(rank)
    dp = DataParallel(model, bucket_mb=bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    grad_err, param_err = None, []
    for step in range(STEPS):
        micro = shard.chunk(micro_batches)
        for ids in micro[:-1]:                # gradient accumulation: no communication ...
            with dp.no_sync():
                (next_token_loss(dp, ids) / micro_batches).backward()
        (next_token_loss(dp, micro[-1]) / micro_batches).backward()   # ... until the last one
        dp.finish()
        if step == 0:
            grad_err = max(_rel(p.grad, ref_grads[n]) for n, p in model.named_parameters())
        opt.step()
        opt.zero_grad()
        param_err.append(max((p - ref_params[step][n]).abs().max().item() for n, p in model.named_parameters()))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    tl = dp.timeline
    launches = [b["launched_at"] for b in tl["buckets"]]
    return {"grad": grad_err, "params": param_err, "flat": flat, "num_buckets": len(dp.buckets),
            "num_params": len(list(model.parameters())),
            "first_bucket_last_param": dp.buckets[0].names[0],
            "launch_sorted": launches == sorted(launches),
            "launched_in_backward": tl["backward_start"] <= launches[0] and launches[-1] <= tl["backward_end"],
            "done_by_finish": all(b["done_at"] is not None and b["done_at"] <= tl["finish_end"] for b in tl["buckets"])}


def _run_all(rank, world):
    reference = _reference()
    results = {name: _train(rank, world, reference, mb) for name, mb in BUCKETS_MB.items()}
    results["accumulate"] = _train(rank, world, reference, 0.05, micro_batches=2)
    results["demo"] = demo(rank, world, 2) if world == 2 else None      # the notebook's entry point, 2 steps
    # finish() before any backward is an error, not a hang
    dp = DataParallel(_model())
    try:
        dp.finish()
        results["finish_error"] = None
    except RuntimeError as e:
        results["finish_error"] = str(e)
    return {"rank": rank, "world": dist.get_world_size(), **results}


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_equals_single_process(world):
    results = launch(_run_all, world)
    assert [(r["rank"], r["world"]) for r in results] == [(i, world) for i in range(world)]
    problems = []
    for rank, r in enumerate(results):
        for case in (*BUCKETS_MB, "accumulate"):
            got = r[case]
            if not got["grad"] <= GRAD_RTOL:
                problems.append(f"{case}, rank {rank}: gradient relative error {got['grad']:.3g} > {GRAD_RTOL}")
            if not all(e <= PARAM_ATOL for e in got["params"]):
                problems.append(f"{case}, rank {rank}: parameter errors per step {got['params']} > {PARAM_ATOL}")
            # the replicas stay identical: same averaged gradient, same update
            if not torch.equal(got["flat"], results[0][case]["flat"]):
                problems.append(f"{case}, rank {rank}: parameters differ from rank 0's")
            if not (got["launch_sorted"] and got["launched_in_backward"] and got["done_by_finish"]):
                problems.append(f"{case}, rank {rank}: bucket timeline out of order: {got}")
        # every bucket size gives the same training, up to the reduction order across ranks
        one, each = r["one_bucket"]["flat"], r["per_param"]["flat"]
        if not (one - each).abs().max().item() <= PARAM_ATOL:
            problems.append(f"rank {rank}: one bucket and one bucket per parameter differ")
        if r["finish_error"] is None or "needs a backward" not in r["finish_error"]:
            problems.append(f"rank {rank}: finish() before backward gave {r['finish_error']!r}")
    assert not problems, "\n".join(problems)
    r0 = results[0]
    assert r0["per_param"]["num_buckets"] == r0["per_param"]["num_params"]
    assert r0["one_bucket"]["num_buckets"] == 1
    assert 1 < r0["medium"]["num_buckets"] < r0["medium"]["num_params"]
    # buckets follow the backward: the first one holds the last parameter (the LM head)
    assert r0["per_param"]["first_bucket_last_param"] == "lm_head.weight"
    if world == 2:
        for r in results:
            d = r["demo"]
            assert len(d["max_abs_error"]) == 2 and max(d["max_abs_error"]) <= PARAM_ATOL
            assert d["buckets"] and all(b["launched_at"] is not None for b in d["buckets"])
            assert d["timeline"]["forward_end"] <= d["timeline"]["backward_start"] <= d["timeline"]["finish_end"]


# ---------------------------------------------------------------------------------------------
# bad input, no processes needed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1.0, ValueError), (math.nan, ValueError),
                                        (math.inf, ValueError), ("25", TypeError), (True, TypeError)])
def test_bad_bucket_size(bad, error):
    with pytest.raises(error, match="bucket_mb"):
        DataParallel(_model(), bucket_mb=bad)


def test_needs_a_module_and_a_process_group():
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        DataParallel(lambda x: x)
    with pytest.raises(RuntimeError, match="needs a process group"):
        DataParallel(_model())
