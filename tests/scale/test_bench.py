"""Module 15's benchmark entry (``llmu.scale.bench``): registered, FLOPs by hand, a step that trains."""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench import runner
from llmu.bench.registry import REGISTRY, TOPICS, load_all
from llmu.scale import bench

ENTRY = bench.TRAIN_STEP


def test_entry_is_registered():
    assert TOPICS.index("mamba") < TOPICS.index("scale") < TOPICS.index("engine")
    load_all()
    assert REGISTRY["train_step"] is ENTRY and ENTRY.module == "15_scale" and ENTRY.x_axis == "H"
    assert {n: p.kind for n, p in ENTRY.providers.items()} == {"torch AdamW": "torch"}
    assert ENTRY.bytes is None
    assert [s["H"] for s in ENTRY.gpu_sizes] == [512, 1024, 2048, 4096]


def test_flops_by_hand():
    size = {"B": 2, "T": 16, "H": 64, "L": 1}
    # one layer, one head of 64: attention 4*64*64, SwiGLU 3*64*192 (8*64/3 -> 192), head 64*256,
    # and the three RMSNorm gains of 64 (llmu.moe.params counts them with the weights that multiply)
    n_matmul = 4 * 64 * 64 + 3 * 64 * 192 + 64 * 256 + 3 * 64
    attention = 6 * 1 * 64 * 17
    assert bench.step_flops(size) == 2 * 16 * (6 * n_matmul + attention)


@pytest.mark.parametrize("bad, error", [({"B": 1, "T": 8, "H": 100, "L": 1}, ValueError),
                                        ({"B": 1, "T": 8, "H": 64}, ValueError),
                                        ({"B": 1.0, "T": 8, "H": 64, "L": 1}, TypeError)])
def test_bad_sizes(bad, error):
    with pytest.raises(error, match="size"):
        bench.step_flops(bad)


def test_a_step_trains():
    model, optimizer, window = bench.step_setup({"B": 2, "T": 16, "H": 64, "L": 1}, "cpu", torch.float32)
    assert window.shape == (2, 17)
    before = [p.detach().clone() for p in model.parameters()]
    loss = bench.step_adamw(model, optimizer, window)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_cpu_sizes_run_through_the_runner():
    results = runner.run(["train_step"], device="cpu", sizes="cpu", entries=[ENTRY], timer=lambda fn: {"ms": 1.0})
    rows = results["rows"]
    assert len(rows) == len(ENTRY.cpu_sizes)
    for row in rows:
        assert row["status"] == "ok", row["reason"]
        assert row["tflops"] == pytest.approx(bench.step_flops(row["size"]) / 1e-3 / 1e12)
