"""Module 12's benchmark entries (``llmu.moe.bench``): registered, formulas by hand, providers that agree.

``moe_grouped_gemm`` and ``moe_grouped_gemm_fine`` time the experts on grouped rows, ``moe_layer``
the whole layer (router to combine).

- The routing of the inputs is the reference layer's own: the experts' outputs on the grouped rows,
  weighted and summed back per token, give ``reference.moe_reference``'s output; and the groups
  are uneven (the point of a grouped GEMM over ragged groups).
- The three providers of each entry agree on one small float32 size: the Triton grouped GEMM (in the interpreter
  here, on the kernel device) and ``torch._grouped_mm`` against the loop over experts. All three
  accumulate float32 products in their own order over ``K <= 48``: ``rtol = atol = 1e-5``, as in
  the kernel tests (``tests/moe/test_kernels.py``) for O(1) entries. ``torch._grouped_mm`` is run
  on the CPU (float32; its GPU path wants bfloat16).
- The CPU sizes run through the runner (``check_cpu_sizes_run``, a stub timer), bad sizes are
  refused, a torch without ``_grouped_mm`` gives a skipped row, and the figure has ``T`` on its x axis.
"""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench import runner
from llmu.bench.registry import REGISTRY, TOPICS, load_all
from llmu.moe import bench, kernels, reference

pytestmark = pytest.mark.kernels

ENTRIES = (bench.MOE_GROUPED_GEMM, bench.MOE_GROUPED_GEMM_FINE)
ALL_ENTRIES = ENTRIES + (bench.MOE_LAYER,)
SMALL = {"T": 24, "k": 2, "E": 5, "H": 32, "F": 48}
TOL = dict(rtol=1e-5, atol=1e-5)


def test_entries_are_registered_with_the_model_shapes():
    assert TOPICS.index("spec") < TOPICS.index("moe") < TOPICS.index("engine")
    load_all()
    for entry in ALL_ENTRIES:
        assert REGISTRY[entry.name] is entry and entry.module == "12_mixture_of_experts"
        assert {n: p.kind for n, p in entry.providers.items()} == {
            "llmu triton": "triton", "torch loop": "torch", "torch grouped_mm": "builtin"}
        assert entry.x_axis == "T" and entry.gpu_dtype == torch.bfloat16
        # one shape per entry, so that a figure has one line per provider against T
        for sizes in (entry.gpu_sizes, entry.cpu_sizes):
            assert len({(s["k"], s["E"], s["H"], s["F"]) for s in sizes}) == 1
            assert [s["T"] for s in sizes] == sorted({s["T"] for s in sizes})
        assert max(s["H"] for s in entry.cpu_sizes) < min(s["H"] for s in entry.gpu_sizes)
    mixtral = bench.MOE_GROUPED_GEMM.gpu_sizes
    assert {(s["E"], s["k"], s["H"], s["F"]) for s in mixtral} == {(8, 2, 4096, 14336)}
    assert [s["T"] for s in mixtral] == [512, 1024, 2048, 4096, 8192, 16384]
    assert {(s["E"], s["k"], s["H"], s["F"]) for s in bench.MOE_GROUPED_GEMM_FINE.gpu_sizes} == {(256, 8, 7168, 2048)}
    assert bench.MOE_LAYER.gpu_sizes == mixtral and bench.MOE_LAYER.cpu_sizes == bench.MOE_GROUPED_GEMM.cpu_sizes


def test_formulas_by_hand():
    size = {"T": 10, "k": 2, "E": 4, "H": 6, "F": 8}
    assert bench.experts_flops(size) == 3 * 2 * (10 * 2) * 6 * 8 == 5760
    # weights 3*4*6*8 = 576, x read twice and out written 3*20*6 = 360, gate/up/h 6*20*8 = 960
    assert bench.experts_bytes(size, 2) == 2 * (576 + 360 + 960) == 3792
    assert bench.experts_bytes(size, 4) == 2 * bench.experts_bytes(size, 2)
    # the whole layer adds the router (2*T*H*E = 480) and the combine (2*T*k*H = 240) ...
    assert bench.layer_flops(size) == 480 + 5760 + 240 == 6480
    # ... and reads the router (E*H = 24), x and y (2*T*H = 120), the gather and combine rows (6*20*6 = 720)
    assert bench.layer_bytes(size, 2) == 2 * (576 + 24 + 120 + 720 + 960) == 4800


@pytest.mark.parametrize("bad, error", [
    ({"T": 8, "k": 2, "E": 4, "H": 8}, ValueError),               # no F
    ({"T": 8, "k": 5, "E": 4, "H": 8, "F": 8}, ValueError),       # k > E
    ({"T": 0, "k": 2, "E": 4, "H": 8, "F": 8}, ValueError),
    ({"T": 8, "k": 2, "E": 4, "H": 8.0, "F": 8}, TypeError),
    ({"T": 8, "k": True, "E": 4, "H": 8, "F": 8}, TypeError),
    ([8, 2, 4, 8, 8], TypeError),
])
def test_bad_sizes_are_refused(bad, error):
    for fn in (bench.experts_flops, lambda s: bench.experts_bytes(s, 2), bench.layer_flops,
               lambda s: bench.layer_bytes(s, 2), lambda s: bench.grouped_setup(s, "cpu", torch.float32),
               lambda s: bench.layer_setup(s, "cpu", torch.float32)):
        with pytest.raises(error, match="size"):
            fn(bad)


def test_inputs_are_the_reference_layers_routing_and_uneven():
    layer = bench.make_layer(SMALL)
    inputs = bench.grouped_setup(SMALL, "cpu", torch.float32)
    order, counts, offsets = kernels.sort_by_expert(layer["experts"], SMALL["E"])
    assert inputs.bounds == tuple(offsets.tolist()) and inputs.ends.tolist() == offsets[1:].tolist()
    assert inputs.ends.dtype == torch.int32 and inputs.x_sorted.shape == (SMALL["T"] * SMALL["k"], SMALL["H"])
    # Sum each token's k expert outputs with its gate weights: the reference layer's output.
    out = bench.experts_loop(*inputs)
    k = SMALL["k"]
    weighted = out * layer["weights"].reshape(-1)[order, None]
    y = torch.zeros(SMALL["T"], SMALL["H"], device="cpu").index_add(0, order // k, weighted)
    want, aux = reference.moe_reference(layer["x"], layer["router_weight"], layer["w_gate"], layer["w_up"],
                                        layer["w_down"], k)
    torch.testing.assert_close(y, want, **TOL)
    assert torch.equal(aux.experts, layer["experts"])
    # uneven groups at every CPU size (a seeded router with a per-expert offset)
    for entry in ENTRIES:
        for size in entry.cpu_sizes:
            sizes = torch.tensor(bench.grouped_setup(size, "cpu", torch.float32).bounds, device="cpu").diff().float()
            assert sizes.max() > 1.2 * sizes.mean(), (entry.name, size, sizes)


def test_providers_agree_on_a_small_size(kdev):
    inputs = bench.grouped_setup(SMALL, "cpu", torch.float32)
    want = bench.experts_loop(*inputs)
    torch.testing.assert_close(bench.experts_grouped_mm(*inputs), want, **TOL)
    on_kdev = bench.GroupedExperts(*(t.to(kdev) if isinstance(t, torch.Tensor) else t for t in inputs))
    torch.testing.assert_close(bench.experts_triton(*on_kdev).cpu(), want, **TOL)


def test_layer_providers_agree_on_a_small_size(kdev):
    inputs = bench.layer_setup(SMALL, "cpu", torch.float32)
    want = bench.layer_loop(*inputs)
    assert want.shape == (SMALL["T"], SMALL["H"])
    torch.testing.assert_close(bench.layer_grouped_mm(*inputs), want, **TOL)
    on_kdev = tuple(t.to(kdev) if isinstance(t, torch.Tensor) else t for t in inputs)
    torch.testing.assert_close(bench.layer_triton(*on_kdev).cpu(), want, **TOL)


def test_cpu_sizes_run(check_cpu_sizes_run):
    rows = check_cpu_sizes_run(list(ALL_ENTRIES))
    assert {r["provider"] for r in rows if r["status"] == "ok"} == {"torch loop", "torch grouped_mm"}


@pytest.mark.parametrize("entry", [bench.MOE_GROUPED_GEMM, bench.MOE_LAYER], ids=lambda e: e.name)
def test_without_grouped_mm_the_builtin_row_is_skipped(monkeypatch, entry):
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    rows = runner.run([entry.name], device="cpu", sizes=entry.cpu_sizes[:1], entries=[entry],
                      timer=lambda fn: (fn(), {"ms": 1.0})[1])["rows"]
    row = next(r for r in rows if r["provider"] == "torch grouped_mm")
    assert row["status"] == "skipped" and "_grouped_mm" in row["reason"]
    assert next(r for r in rows if r["provider"] == "torch loop")["status"] == "ok"


def test_figure_has_tokens_on_the_x_axis():
    pytest.importorskip("plotly")
    from llmu.bench import figure

    entry = bench.MOE_GROUPED_GEMM
    results = runner.run([entry.name], device="cpu", sizes="cpu", entries=[entry], timer=lambda fn: {"ms": 1.0})
    fig = figure(results, entry.name, recorded=False)
    assert {tr.name.split(" · ")[0] for tr in fig.data} == {"torch loop over experts", "torch._grouped_mm"}
    for trace in fig.data:
        assert list(trace.x) == [s["T"] for s in entry.cpu_sizes]
    assert fig.layout.xaxis.title.text == "T"


# -- moe_gather_rows: the permute step's copy (the notebook's exercise 4) ----------------------------

GATHER_SMALL = {"T": 37, "k": 2, "E": 6, "H": 200}   # 74 rows and 200 columns: ragged tiles both ways


def test_gather_entry_is_registered_with_mixtrals_shape():
    load_all()
    entry = bench.MOE_GATHER_ROWS
    assert REGISTRY["moe_gather_rows"] is entry and entry.module == "12_mixture_of_experts"
    assert {n: p.kind for n, p in entry.providers.items()} == {"llmu triton": "triton", "torch index_select": "builtin"}
    assert entry.providers["llmu triton"].fn is kernels.gather_rows
    assert entry.x_axis == "T" and entry.flops is None and entry.gpu_dtype == torch.bfloat16
    assert {(s["k"], s["E"], s["H"]) for s in entry.gpu_sizes} == {(2, 8, 4096)}
    assert [s["T"] for s in entry.gpu_sizes] == [s["T"] for s in bench.MOE_GROUPED_GEMM.gpu_sizes]
    assert len({(s["k"], s["E"], s["H"]) for s in entry.cpu_sizes}) == 1
    assert [s["T"] for s in entry.cpu_sizes] == sorted({s["T"] for s in entry.cpu_sizes})


def test_gather_bytes_by_hand():
    # M = 20 rows of 6: read and written (2*20*6 = 240 elements), 20 int64 indices
    assert bench.gather_bytes({"T": 10, "k": 2, "E": 4, "H": 6}, 2) == 2 * 240 + 8 * 20 == 640
    assert bench.gather_bytes({"T": 10, "k": 2, "E": 4, "H": 6}, 4) == 4 * 240 + 8 * 20


@pytest.mark.parametrize("bad, error", [
    ({"T": 8, "k": 2, "E": 4}, ValueError),                        # no H
    ({"T": 8, "k": 5, "E": 4, "H": 8}, ValueError),               # k > E
    ({"T": 8, "k": 2, "E": 4, "H": 0}, ValueError),
    ({"T": 8, "k": 2, "E": 4.0, "H": 8}, TypeError),
])
def test_bad_gather_sizes_are_refused(bad, error):
    for fn in (lambda s: bench.gather_bytes(s, 2), lambda s: bench.gather_setup(s, "cpu", torch.float32)):
        with pytest.raises(error, match="size"):
            fn(bad)


def test_gather_inputs_are_the_layers_tokens_in_expert_order():
    x, src = bench.gather_setup(GATHER_SMALL, "cpu", torch.float32)
    layer = bench.make_layer({**GATHER_SMALL, "F": 8})
    order, _, _ = kernels.sort_by_expert(layer["experts"], GATHER_SMALL["E"])
    assert torch.equal(x, layer["x"]) and torch.equal(src, order // GATHER_SMALL["k"])
    assert src.dtype == torch.int64 and src.shape == (GATHER_SMALL["T"] * GATHER_SMALL["k"],)


def test_gather_providers_agree_on_a_ragged_size(kdev):
    x, src = bench.gather_setup(GATHER_SMALL, "cpu", torch.float32)
    want = x[src]
    assert torch.equal(bench.gather_torch(x, src), want)
    assert torch.equal(bench.MOE_GATHER_ROWS.providers["llmu triton"].fn(x.to(kdev), src.to(kdev)).cpu(), want)


def test_gather_cpu_sizes_run_and_give_gbs_only():
    entry = bench.MOE_GATHER_ROWS
    rows = runner.run([entry.name], device="cpu", sizes="cpu", entries=[entry],
                      timer=lambda fn: (fn(), {"ms": 1.0})[1])["rows"]
    assert len(rows) == len(entry.cpu_sizes) * len(entry.providers)
    for row in rows:
        if row["kind"] == "triton":
            assert row["status"] == "skipped" and row["reason"]
        else:
            assert row["status"] == "ok", row["reason"]
            assert row["gbs"] == pytest.approx(bench.gather_bytes(row["size"], 4) / 1e-3 / 1e9)
            assert row["flops"] is None and row["tflops"] is None
