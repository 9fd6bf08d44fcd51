"""llmu.grading.data_parallel.trial, the grader of notebook 14's capstone, run on llmu's own
strategies: each must come out equal to the single process, with the collectives it is known to call.

The four strategies are llmu's references, under the names the exercise asks for, in a module file
written by llmu.cell_module as the notebook's %%module cell writes it.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from llmu.cell_module import write_module
from llmu.distributed import launch
from llmu.grading.data_parallel import STRATEGIES, expected_buckets, trial
from llmu.models import tiny_llama

LIBRARY = textwrap.dedent("""
    from llmu.parallel.data_parallel import DataParallel, all_reduce_gradients
    from llmu.parallel.sharded_optimizer import ShardedOptimizer

    def OverlappedDP(model):
        return DataParallel(model, bucket_mb=1e-6)      # a bucket per parameter

    def BucketedDP(model, bucket_mb):
        return DataParallel(model, bucket_mb=bucket_mb)

    def ZeRO1(params, optimizer_cls, **kwargs):
        return ShardedOptimizer(params, optimizer_cls, reduce_order="collective", **kwargs)
""")


@pytest.fixture(scope="module")
def library_module(tmp_path_factory):
    module = write_module("llmu_dp_trial_reference", LIBRARY, tmp_path_factory.mktemp("dp"))
    yield module
    sys.modules.pop(module.__name__, None)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_llmus_strategies_equal_the_single_process(strategy, library_module):
    results = launch(trial, 2, library_module.__file__, library_module.__name__, strategy)
    for rank, res in enumerate(results):
        assert len(res["params"]) == res["steps"] == 3
        for step in range(res["steps"]):
            for name, p in res["params"][step].items():
                assert torch.equal(p, res["reference"][step][name]), (rank, step, name)
    res = results[0]
    reduces = [c for c in res["calls"] if c["op"] == "all_reduce" and c["step"] == 0]
    if strategy == "naive":
        assert sum(c["numel"] for c in reduces) == res["num_params"]
        assert all(c["phase"] == "after" and not c["async"] for c in reduces)
    elif strategy == "overlapped":
        assert len(reduces) == len(res["params"][0]) and all(c["phase"] == "backward" and c["async"] for c in reduces)
        assert any(c["op"] == "broadcast" and c["phase"] == "build" for c in res["calls"])
    elif strategy == "bucketed":
        assert [c["numel"] for c in reduces] == res["buckets"] and len(res["buckets"]) == 3
    else:
        assert not reduces
        ops = {c["op"] for c in res["calls"] if c["step"] == 0}
        assert any("reduce_scatter" in op for op in ops) and any("all_gather" in op for op in ops)
        assert res["state_numel"] == 2 * (res["num_params"] // 2)        # 40,272 parameters: even


def test_expected_buckets_is_the_rule_of_data_parallel():
    model = tiny_llama(0).requires_grad_(True)
    sizes = expected_buckets(model, 0.05)
    assert sum(sizes) == sum(p.numel() for p in model.parameters())
    limit = int(0.05 * 2**20)
    assert all(4 * s >= limit for s in sizes[:-1])                # every bucket but the last reached the size
    assert expected_buckets(model, 1e-6) == [p.numel() for p in reversed(list(model.parameters()))]


def test_a_bad_strategy_is_refused(library_module):
    with pytest.raises(ValueError, match="strategy"):
        trial(0, 1, library_module.__file__, library_module.__name__, "fsdp")
