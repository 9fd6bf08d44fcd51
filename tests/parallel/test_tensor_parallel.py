"""Tensor parallelism (llmu.parallel.tensor_parallel) on real gloo processes.

The oracle is the unsharded layer, built from the same seed on every rank: an ``nn.Linear``, or
layer 0 of ``tiny_llama`` (its ``MLP``, ``Attention`` and whole ``DecoderLayer``). Each rank runs
both with the loss ``<y, dy>`` and reports the largest relative differences of the output, the
input gradient, and the gradient of each of its weight shards against the matching slice of the
full layer's gradient (rows for column-parallel, columns for row-parallel, the whole bias of a
row-parallel layer). It also counts the collectives the layers issue: Megatron's analysis says
one all-reduce of ``B*T*d_model`` numbers forward and one backward per MLP and per attention.

Spawning a process group costs seconds, so each world size runs every case inside ONE ``launch``.

Tolerance, float32, relative to ``max(|reference|, 1)``: ``1e-5``. A sharded matmul sums its
``K`` products in ``W`` pieces and the all-reduce adds the pieces, where the full matmul sums
them in one blocked loop: the same numbers, added in another order, so each output differs by a
few roundings of its partial sums (``6e-8`` relative each, times up to ``sqrt(K)`` terms of
``K = 64``). The largest error seen over all cases is ``1.6e-6`` (4 ranks).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import llmu  # noqa: F401  (sets the Triton mode before anything imports triton)
from llmu.distributed import launch
from llmu.models import tiny_llama
from llmu.models.backends import get_attention_backend
from llmu.parallel import tensor_parallel as TP

RTOL = 1e-5
BATCH, SEQ = 2, 8

#: The models per world size: query and KV heads divisible by W, GQA in both, biases in one.
MODELS = {
    2: {"gqa_6_2": dict(), "bias_4_2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                              attention_bias=True, attention_out_bias=True)},
    4: {"gqa_8_4": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=6)},
}


def _rel(a, b):
    return ((a - b).abs().max() / max(b.abs().max().item(), 1.0)).item()


def _shard_errors(pairs, world, rank):
    """Largest error of each shard's weight (and bias) gradient against the full gradient's slice."""
    worst = 0.0
    for shard, full in pairs:
        dim = 0 if isinstance(shard, TP.ColumnParallelLinear) else 1
        worst = max(worst, _rel(shard.weight.grad, full.weight.grad.chunk(world, dim)[rank]))
        if full.bias is not None:
            full_bias = full.bias.grad.chunk(world, 0)[rank] if dim == 0 else full.bias.grad
            worst = max(worst, _rel(shard.bias.grad, full_bias))
    return worst


def _counts(log, numel):
    """(forward all-reduces, backward all-reduces, whether every one moved ``numel`` float32s)."""
    fwd = sum(c.op == "all_reduce" and c.phase == "forward" for c in log)
    bwd = sum(c.op == "all_reduce" and c.phase == "backward" for c in log)
    sizes_ok = all(c.numel == numel and c.nbytes == 4 * numel for c in log)
    return fwd, bwd, sizes_ok, len(log)


def _linears(rank, world):
    """Column-parallel (split and gathered output) then row-parallel (split input), on nn.Linear."""
    torch.manual_seed(0)
    col_full, row_full = nn.Linear(12, 8 * world), nn.Linear(8 * world, 10)
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(3, 5, 12, generator=g)
    dy = torch.randn(3, 5, 10, generator=g)

    col = TP.ColumnParallelLinear.from_linear(col_full, gather_output=True)
    row = TP.RowParallelLinear.from_linear(row_full, input_is_parallel=False)
    x_ref = x_all.clone().requires_grad_()
    y_ref = row_full(torch.relu(col_full(x_ref)))
    (y_ref * dy).sum().backward()

    x = x_all.clone().requires_grad_()
    with TP.count_communication() as log:
        y = row(torch.relu(col(x)))
        (y * dy).sum().backward()
    ops = sorted((c.op, c.phase) for c in log)
    return {"y": _rel(y, y_ref), "dx": _rel(x.grad, x_ref.grad),
            "d_shards": _shard_errors([(col, col_full), (row, row_full)], world, rank),
            # f in backward, gather forward; the scatter's all-gather backward; g forward
            "ops_ok": ops == sorted([("all_reduce", "backward"), ("all_gather", "forward"),
                                     ("all_gather", "backward"), ("all_reduce", "forward")])}


def _blocks(rank, world, overrides):
    """The MLP, the attention and the whole decoder layer of tiny_llama, each against the full one."""
    model = tiny_llama(3, **overrides).train().requires_grad_(True)
    full = model.layers[0]
    c = model.config
    numel = BATCH * SEQ * c.hidden_size
    g = torch.Generator().manual_seed(4)
    x_all = torch.randn(BATCH, SEQ, c.hidden_size, generator=g)
    dy = torch.randn(x_all.shape, generator=g)
    cos, sin = model.rope_tables(0, SEQ)
    naive = get_attention_backend("naive")

    # cut before any backward: the copied norms must start without gradients
    mlp = TP.TensorParallelMLP.from_mlp(full.mlp)
    attn = TP.TensorParallelAttention.from_attention(full.self_attn)
    layer = TP.TensorParallelDecoderLayer.from_layer(full)
    parts = {
        "mlp": (mlp, lambda x: full.mlp(x), lambda x: mlp(x),
                [(mlp.gate_proj, full.mlp.gate_proj), (mlp.up_proj, full.mlp.up_proj),
                 (mlp.down_proj, full.mlp.down_proj)]),
        "attention": (attn, lambda x: full.self_attn(x, cos, sin, backend=naive)[0], lambda x: attn(x, cos, sin),
                      [(attn.q_proj, full.self_attn.q_proj), (attn.k_proj, full.self_attn.k_proj),
                       (attn.v_proj, full.self_attn.v_proj), (attn.o_proj, full.self_attn.o_proj)]),
        "layer": (layer, lambda x: full(x, cos, sin, backend=naive)[0], lambda x: layer(x, cos, sin),
                  [(getattr(layer.self_attn, n), getattr(full.self_attn, n))
                   for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
                  + [(getattr(layer.mlp, n), getattr(full.mlp, n)) for n in ("gate_proj", "up_proj", "down_proj")]),
    }
    out = {}
    for name, (_, run_full, run_tp, pairs) in parts.items():
        model.zero_grad()
        x_ref = x_all.clone().requires_grad_()
        y_ref = run_full(x_ref)
        (y_ref * dy).sum().backward()
        x = x_all.clone().requires_grad_()
        with TP.count_communication() as log:
            y = run_tp(x)
            (y * dy).sum().backward()
        out[name] = {"y": _rel(y, y_ref), "dx": _rel(x.grad, x_ref.grad),
                     "d_shards": _shard_errors(pairs, world, rank), "counts": _counts(log, numel)}
    out["layer"]["d_norms"] = max(_rel(layer.input_layernorm.weight.grad, full.input_layernorm.weight.grad),
                                  _rel(layer.post_attention_layernorm.weight.grad,
                                       full.post_attention_layernorm.weight.grad))
    out["local_heads"] = (attn.local_heads, attn.local_kv_heads)
    out["expected"] = TP.megatron_all_reduces(BATCH, SEQ, c.hidden_size)
    return out


def _refusals(world):
    """The errors a rank raises for sizes ``W`` cannot split (inside the group, no collective runs)."""
    messages = {}
    cases = {
        "heads": lambda: TP.TensorParallelAttention.from_attention(
            tiny_llama(0, num_attention_heads=3, num_key_value_heads=3, head_dim=16).layers[0].self_attn),
        "kv_heads": lambda: TP.TensorParallelAttention.from_attention(
            tiny_llama(0, num_attention_heads=8, num_key_value_heads=1 if world == 2 else 2,
                       head_dim=6).layers[0].self_attn),
        "ffn": lambda: TP.TensorParallelMLP.from_mlp(tiny_llama(0, intermediate_size=2 * world + 1).layers[0].mlp),
        "column": lambda: TP.ColumnParallelLinear.from_linear(nn.Linear(4, world + 1)),
        "row": lambda: TP.RowParallelLinear.from_linear(nn.Linear(world + 1, 4)),
        "row_input": lambda: TP.RowParallelLinear.from_linear(nn.Linear(2 * world, 4))(torch.randn(3, 2 * world)),
    }
    for name, make in cases.items():
        try:
            make()
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


def _run_all(rank, world):
    return {"linears": _linears(rank, world),
            **{name: _blocks(rank, world, overrides) for name, overrides in MODELS[world].items()},
            "refusals": _refusals(world)}


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_equals_unsharded(world):
    """Every case of one world size in one launch: outputs, gradients, collectives, refusals."""
    results = launch(_run_all, world)
    problems = []
    for rank, got in enumerate(results):
        lin = got["linears"]
        if max(lin["y"], lin["dx"], lin["d_shards"]) > RTOL or not lin["ops_ok"]:
            problems.append(f"rank {rank}, linears: {lin}")
        for model in MODELS[world]:
            m = got[model]
            expected = m["expected"]
            for part, (fwd, bwd) in {"mlp": (1, 1), "attention": (1, 1),
                                     "layer": (expected["forward"], expected["backward"])}.items():
                r = m[part]
                errors = {key: r[key] for key in ("y", "dx", "d_shards")}
                if not all(e <= RTOL for e in errors.values()):
                    problems.append(f"rank {rank}, {model}/{part}: relative errors {errors} above {RTOL}")
                # (forward, backward, all of B*T*d numbers, nothing else issued)
                if r["counts"] != (fwd, bwd, True, fwd + bwd):
                    problems.append(f"rank {rank}, {model}/{part}: collectives (fwd, bwd, sizes ok, total) "
                                    f"{r['counts']}, Megatron says ({fwd}, {bwd}, True, {fwd + bwd})")
            if m["layer"]["d_norms"] > RTOL:
                problems.append(f"rank {rank}, {model}: norm gains' gradients differ by {m['layer']['d_norms']}")
    assert not problems, "\n".join(problems)
    # the analysis the counts were checked against: 2 + 2 all-reduces of B*T*d float32 per layer
    assert results[0][next(iter(MODELS[world]))]["expected"] == {
        "forward": 2, "backward": 2, "numel_each": BATCH * SEQ * 48, "bytes_each": 4 * BATCH * SEQ * 48}
    assert results[0]["gqa_6_2" if world == 2 else "gqa_8_4"]["local_heads"] == ((3, 1) if world == 2 else (2, 1))

    refusals = results[0]["refusals"]
    assert refusals["heads"] == (f"num_heads=3 is not divisible by world_size={world}: "
                                 "every rank must hold the same share")
    assert refusals["kv_heads"].startswith(f"num_kv_heads={1 if world == 2 else 2} is not divisible by "
                                           f"world_size={world}")
    assert refusals["ffn"].startswith(f"intermediate_size={2 * world + 1} is not divisible")
    assert refusals["column"].startswith(f"out_features={world + 1} is not divisible")
    assert refusals["row"].startswith(f"in_features={world + 1} is not divisible")
    assert "x must end in this rank's in_features/W=2" in refusals["row_input"]


def test_demo_two_ranks():
    """The notebook's entry point: one decoder layer, its errors and its four all-reduces."""
    for got in launch(TP.demo, 2):
        assert max(got["y"], got["dx"], got["d_shards"], got["d_norms"]) < 1e-4   # absolute, |values| ~ 10
        assert (got["forward"], got["backward"]) == (2, 2)
        assert [c[2] for c in got["collectives"]] == [got["expected"]["bytes_each"]] * 4


def test_a_nope_layer_splits_too():
    """A model without positional rotation (NoPE: ``rope_tables`` gives None) splits the same way."""
    nope = {**TP.DEMO_MODEL, "position_embedding": "none"}
    for got in launch(TP.demo, 2, 2, 16, 0, nope):
        assert max(got["y"], got["dx"], got["d_shards"], got["d_norms"]) < 1e-4


# ---------------------------------------------------------------------------------------------
# bad input, no processes needed
# ---------------------------------------------------------------------------------------------


def test_shard_size():
    assert TP.shard_size("num_heads", 8, 4) == 2
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by world_size=4"):
        TP.shard_size("num_heads", 6, 4)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        TP.shard_size("num_heads", 6, 0)
    with pytest.raises(ValueError, match="size must be a positive int"):
        TP.shard_size("num_heads", True, 2)


def test_layers_need_a_process_group_and_a_linear():
    with pytest.raises(TypeError, match="linear must be a linear layer"):
        TP.ColumnParallelLinear.from_linear(nn.ReLU())
    with pytest.raises(RuntimeError, match="needs a process group"):
        TP.ColumnParallelLinear.from_linear(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="needs a process group"):
        TP.RowParallelLinear.from_linear(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="llmu.models.llama.Attention"):
        TP.TensorParallelAttention.from_attention(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="gate_proj, up_proj and down_proj"):
        TP.TensorParallelMLP.from_mlp(nn.Linear(4, 4))


def test_count_communication_is_empty_without_collectives():
    with TP.count_communication() as log:
        torch.ones(3).sum()
    assert log == []
