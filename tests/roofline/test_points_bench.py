"""The registered ops as roofline points, module 05's bench entries, and the plot helper."""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu import runtime
from llmu.bench.registry import REGISTRY, load_all
from llmu.roofline import bench, gpu_roofs, registry_points, roofline_figure


def test_entries_are_registered():
    load_all()
    for name in ("gemm", "gemv"):
        entry = REGISTRY[name]
        assert entry.module == "05_prefill_decode"
        assert entry.gpu_sizes and entry.cpu_sizes
    # the GEMM times llmu's Triton matmul beside PyTorch's; the GEMV PyTorch's alone
    assert {n: p.kind for n, p in REGISTRY["gemm"].providers.items()} == {"torch": "builtin", "llmu triton": "triton"}
    assert {p.kind for p in REGISTRY["gemv"].providers.values()} == {"builtin"}
    assert {"M": 4096, "N": 4096, "K": 4096} in REGISTRY["gemm"].gpu_sizes
    assert {"B": 1, "N": 4096, "K": 4096} in REGISTRY["gemv"].gpu_sizes


def test_formulas():
    assert bench.gemm_entry_flops({"M": 2, "N": 4, "K": 3}) == 48
    assert bench.gemm_entry_bytes({"M": 2, "N": 4, "K": 3}, 4) == 104
    assert bench.gemv_entry_flops({"B": 1, "N": 4, "K": 3}) == 24
    assert bench.gemv_entry_bytes({"B": 1, "N": 4, "K": 3}, 2) == 2 * (12 + 3 + 4)


@pytest.mark.parametrize("name", ["gemm", "gemv"])
def test_provider_matches_matmul(name):
    entry = load_all()[name]
    x, w = entry.setup(entry.cpu_sizes[0], torch.device("cpu"), torch.float32)
    # fp32, same products; only the summation order may differ between the library calls.
    torch.testing.assert_close(entry.providers["torch"].fn(x, w), x @ w.T, atol=1e-4, rtol=1e-4)
    if "llmu triton" in entry.providers:  # on the kernel device, at a size the interpreter runs quickly
        x, w = entry.setup({"M": 40, "N": 72, "K": 100}, runtime.kernel_device(), torch.float32)
        torch.testing.assert_close(entry.providers["llmu triton"].fn(x, w), x @ w.T, atol=1e-4, rtol=1e-4)


def test_registry_points_classify_prefill_and_decode():
    h200 = gpu_roofs()[0]
    points = registry_points(h200)
    by = {(p["entry"], p["size_label"]): p for p in points}
    gemv = by[("gemv", "B=1 N=4096 K=4096")]
    gemm = by[("gemm", "M=4096 N=4096 K=4096")]
    assert gemv["phase"] == "decode" and gemv["bound"] == "memory"
    assert gemm["phase"] == "prefill" and gemm["bound"] == "compute"
    assert gemv["attainable"] == pytest.approx(gemv["intensity"] * h200.bandwidth)
    assert gemm["attainable"] == h200.peak_flops
    # Row-wise ops have one intensity at every size: no prefill/decode distinction.
    assert {p["phase"] for p in points if p["entry"] == "rms_norm"} == {"both"}
    # Only entries with formulas: the whole-model decode benchmark has none.
    assert not any(p["entry"] == "decode_tokens_per_s" for p in points)
    only = registry_points(names=["gemv"], sizes="cpu")
    assert {p["entry"] for p in only} == {"gemv"} and "bound" not in only[0]
    with pytest.raises(ValueError, match="unknown entry"):
        registry_points(names=["nope"])
    with pytest.raises(ValueError, match="sizes"):
        registry_points(sizes="tpu")


def test_roofline_figure():
    roofs = gpu_roofs()
    fig = roofline_figure(roofs, [dict(intensity=1.0, gflops=100.0, label="gemv", phase="decode", group="ops")],
                          highlight=roofs[0].name)
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    names = [t.name for t in fig.data]
    assert any("H200" in (n or "") for n in names) and "ops" in names
    with pytest.raises(ValueError, match="at least one roof"):
        roofline_figure([])
    with pytest.raises(ValueError, match="intensity > 0"):
        roofline_figure(roofs, [dict(intensity=0.0, gflops=1.0)])
