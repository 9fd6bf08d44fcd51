"""Expert parallelism (llmu.moe.expert_parallel) on real gloo processes, and the launcher (llmu.distributed).

The oracle is the single-process ``MoEFeedForward`` on the concatenated batch, with the same
weights (every rank builds it from the same seed). Each rank runs both layers with the same loss,
``<y, dy> + lb_loss + z_loss``, and reports the largest differences: outputs on its token shard,
input gradients, the gradients of its own experts (a slice of the single-process ones), the
router gradient after the all-reduce (SUM), the routing decisions and the global aux losses.

Spawning a process group costs seconds, so each world size runs every case inside ONE
``launch``; the rank function returns a dict per case and the tests assert on them.

Tolerances, float32, relative to the largest reference value (``max(|ref|, 1)``): ``2e-6``.
The outputs, ``dx`` and the expert gradients are the same products summed in the same order as
the single process (an expert sees its rows in global token order, each token adds its ``k``
rows in expert order), so they agree to the bit or to an ulp (a matmul of a different number of
rows may block its sums differently). The router gradient and the global losses are sums over
the batch taken in another grouping (per rank, then across ranks): a few float32 roundings
(``6e-8`` relative each). The Triton path's grouped GEMM accumulates its float32 products in
another order than torch's matmul. The largest error seen over all cases is ``1.8e-7``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import llmu  # noqa: F401  (sets the Triton mode before anything imports triton)
from llmu.distributed import launch
from llmu.moe import expert_parallel as EP
from llmu.moe.layer import MoEFeedForward

RTOL = 2e-6
HIDDEN, FFN = 16, 24


# ---------------------------------------------------------------------------------------------
# the cases, run on every rank of one launch
# ---------------------------------------------------------------------------------------------


def _case(num_experts, k, renormalize, shards, skew=None, impl="torch", seed=0):
    """``shards``: tokens per rank; ``skew``: experts the router is pushed towards (all others
    get almost nothing), to make ranks and experts that receive no rows at all."""
    return dict(num_experts=num_experts, k=k, renormalize=renormalize, shards=shards, skew=skew, impl=impl,
                seed=seed)


CASES = {
    2: {
        "k2_renorm": _case(4, 2, True, [6, 5]),
        "k1_raw": _case(4, 1, False, [7, 7], seed=1),
        "k2_raw_rank1_idle": _case(4, 2, False, [6, 6], skew=[0, 1], seed=2),      # rank 1 receives nothing
        "k1_expert0_only": _case(4, 1, False, [5, 6], skew=[0], seed=3),           # experts 1-3 receive nothing
        "k2_empty_shard": _case(4, 2, True, [9, 0], seed=4),                       # rank 1 has no tokens
        "k2_triton": _case(4, 2, True, [6, 5], impl="triton", seed=5),
    },
    4: {
        "k2_renorm": _case(8, 2, True, [5, 4, 6, 3]),
        "k1_one_expert_each": _case(4, 1, False, [4, 4, 4, 4], seed=1),
        "k2_half_idle": _case(8, 2, True, [4, 5, 4, 5], skew=[0, 1, 2, 3], seed=2),  # ranks 2, 3 receive nothing
        "k1_raw_empty_shard": _case(8, 1, False, [5, 0, 3, 4], seed=3),
        "k2_triton": _case(8, 2, False, [3, 4, 5, 2], impl="triton", seed=4),
    },
}


def _rel(a, b):
    return ((a - b).abs().max() / max(b.abs().max().item(), 1.0)).item() if b.numel() else 0.0


def _run_case(rank, world, case):
    torch.manual_seed(case["seed"])
    moe = MoEFeedForward(HIDDEN, FFN, case["num_experts"], case["k"], renormalize=case["renormalize"], impl="torch")
    g = torch.Generator().manual_seed(case["seed"] + 100)
    x_all = torch.randn(sum(case["shards"]), HIDDEN, generator=g)
    dy_all = torch.randn(x_all.shape, generator=g)
    if case["skew"] is not None:
        # a shared direction in every token that the favoured experts' router rows align with
        x_all[:, 0] += 4.0
        with torch.no_grad():
            favoured = torch.zeros(case["num_experts"], dtype=torch.bool)
            favoured[case["skew"]] = True
            moe.router.weight[:, 0] = torch.where(favoured, 2.0, -2.0)
    start = sum(case["shards"][:rank])
    mine = slice(start, start + case["shards"][rank])

    # the single-process layer on the whole batch
    x_ref = x_all.clone().requires_grad_()
    y_ref = moe(x_ref)
    ref_aux = moe.last_aux
    ((y_ref * dy_all).sum() + ref_aux.lb_loss + ref_aux.z_loss).backward()

    # the expert-parallel layer on this rank's shard (3-d input: the layer takes (..., H))
    layer = EP.ExpertParallelMoE.from_moe(moe, impl=case["impl"])
    x = x_all[mine].clone().view(1, -1, HIDDEN).requires_grad_()
    y = layer(x)
    aux = layer.last_aux
    ((y * dy_all[mine].view(1, -1, HIDDEN)).sum() + aux.lb_loss + aux.z_loss).backward()
    layer.all_reduce_router_grad()

    experts = slice(layer.first_expert, layer.first_expert + layer.num_local_experts)
    return {
        "y": _rel(y.view(-1, HIDDEN), y_ref[mine].detach()),
        "dx": _rel(x.grad.view(-1, HIDDEN), x_ref.grad[mine]),
        "d_experts": max(_rel(getattr(layer, n).grad, getattr(moe, n).grad[experts])
                         for n in ("w_gate", "w_up", "w_down")),
        "d_router": _rel(layer.router.weight.grad, moe.router.weight.grad),
        "lb_loss": _rel(aux.lb_loss.detach(), ref_aux.lb_loss.detach()),
        "z_loss": _rel(aux.z_loss.detach(), ref_aux.z_loss.detach()),
        "same_routing": bool(torch.equal(aux.experts, ref_aux.experts[mine])
                             and torch.equal(aux.weights, ref_aux.weights[mine])),
        "tokens_per_expert": aux.tokens_per_expert.tolist(),
        "ref_tokens_per_expert": ref_aux.tokens_per_expert.tolist(),
        "traffic": layer.last_traffic.tolist(),
        "rows_received": [layer.last_traffic[:, d].sum().item() for d in range(world)],
    }


def _fused_layer_gives_the_same_slice() -> bool:
    """``from_moe`` of a layer holding ``w_gate_up`` fused takes the same experts as of its twin
    holding ``w_gate`` and ``w_up`` apart (the fused weight is ``cat(w_gate, w_up)`` per expert)."""
    torch.manual_seed(0)
    apart = MoEFeedForward(HIDDEN, FFN, 4, 2)
    fused = MoEFeedForward(HIDDEN, FFN, 4, 2, fused_gate_up=True)
    with torch.no_grad():
        fused.router.weight.copy_(apart.router.weight)
        fused.w_gate_up.copy_(torch.cat([apart.w_gate, apart.w_up], dim=1))
        fused.w_down.copy_(apart.w_down)
    a, f = EP.ExpertParallelMoE.from_moe(apart), EP.ExpertParallelMoE.from_moe(fused)
    return all(torch.equal(getattr(a, n), getattr(f, n)) for n in ("w_gate", "w_up", "w_down")) and \
        torch.equal(a.router.weight, f.router.weight)


def _run_all_cases(rank, world):
    return {"rank": rank, "world": dist.get_world_size(), "fused_same_slice": _fused_layer_gives_the_same_slice(),
            **{name: _run_case(rank, world, case) for name, case in CASES[world].items()}}


ERROR_KEYS = ("y", "dx", "d_experts", "d_router", "lb_loss", "z_loss")


def _problems(world, results):
    """Everything that differs from the single-process layer, as readable lines."""
    problems = []
    if [r["rank"] for r in results] != list(range(world)) or any(r["world"] != world for r in results):
        got = [(r["rank"], r["world"]) for r in results]
        problems.append(f"launch returned (rank, world) {got}, not ranks 0..{world - 1} of {world} in order")
    for name, case in CASES[world].items():
        for rank, got in enumerate(r[name] for r in results):
            errors = {key: got[key] for key in ERROR_KEYS}
            if not all(err <= RTOL for err in errors.values()):
                problems.append(f"{name}, rank {rank}: relative errors {errors} above {RTOL}")
            if not got["same_routing"]:
                problems.append(f"{name}, rank {rank}: routing differs from the single-process layer")
            if got["tokens_per_expert"] != got["ref_tokens_per_expert"]:
                problems.append(f"{name}, rank {rank}: tokens_per_expert {got['tokens_per_expert']}, "
                                f"single process {got['ref_tokens_per_expert']}")
            # every rank sees the same matrix, and sends each of its tokens' k copies somewhere
            if got["traffic"] != results[0][name]["traffic"]:
                problems.append(f"{name}, rank {rank}: traffic {got['traffic']} differs from rank 0's")
        sent = [sum(row) for row in results[0][name]["traffic"]]
        if sent != [n * case["k"] for n in case["shards"]]:
            problems.append(f"{name}: rows sent per rank {sent}, expected {case['k']} x {case['shards']}")
    return problems


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_single_process(world):
    """All the cases of one world size in one launch: forward, backward, aux losses, traffic."""
    results = launch(_run_all_cases, world)
    problems = _problems(world, results)
    assert not problems, "\n".join(problems)
    assert all(r["fused_same_slice"] for r in results), "from_moe of a fused gate-up layer took other experts"
    # the skewed cases test what they claim: some ranks / experts really receive zero rows
    if world == 2:
        assert results[0]["k2_raw_rank1_idle"]["rows_received"] == [24, 0]
        assert results[0]["k1_expert0_only"]["tokens_per_expert"] == [11, 0, 0, 0]
    else:
        assert results[0]["k2_half_idle"]["rows_received"][2:] == [0, 0]


# ---------------------------------------------------------------------------------------------
# bad input, no processes needed
# ---------------------------------------------------------------------------------------------


def test_experts_per_rank():
    assert EP.experts_per_rank(8, 4) == 2
    assert EP.experts_per_rank(4, 4) == 1
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by world_size=4"):
        EP.experts_per_rank(6, 4)
    with pytest.raises(ValueError, match="num_experts=2 is not divisible by world_size=4"):
        EP.experts_per_rank(2, 4)
    with pytest.raises(ValueError, match="world_size"):
        EP.experts_per_rank(4, 0)
    with pytest.raises(ValueError, match="num_experts"):
        EP.experts_per_rank(True, 1)


def _local_inputs(num_experts=4, world=2, hidden=HIDDEN, ffn=FFN, tokens=3):
    local = num_experts // world
    return (torch.randn(tokens, hidden), torch.randn(num_experts, hidden), torch.randn(local, ffn, hidden),
            torch.randn(local, ffn, hidden), torch.randn(local, hidden, ffn))


def test_check_expert_parallel_inputs_accepts_a_rank_slice():
    assert EP.check_expert_parallel_inputs(*_local_inputs(), 2, world_size=2) == (4, 2)


@pytest.mark.parametrize("which, bad, match", [
    ("x", "x", "x must be a torch.Tensor"),
    ("router_weight", torch.randn(4, HIDDEN + 1), r"router_weight must be \(E, H=16\)"),
    ("w_gate", torch.randn(4, FFN, HIDDEN), r"w_gate must be \(E/W=2, F, H=16\)"),   # the full stack
    ("w_up", torch.randn(2, FFN + 1, HIDDEN), "w_up must have w_gate's shape"),
    ("w_down", torch.randn(2, FFN, HIDDEN), r"w_down must be \(E/W=2, H=16, F=24\)"),
])
def test_check_expert_parallel_inputs_names_the_bad_argument(which, bad, match):
    names = ("x", "router_weight", "w_gate", "w_up", "w_down")
    args = dict(zip(names, _local_inputs()))
    args[which] = bad
    with pytest.raises((ValueError, TypeError), match=match):
        EP.check_expert_parallel_inputs(*args.values(), 2, world_size=2)


def test_check_expert_parallel_inputs_refuses_bad_k_and_uneven_experts():
    with pytest.raises(ValueError, match="k must be an int with 1 <= k <= E"):
        EP.check_expert_parallel_inputs(*_local_inputs(), 5, world_size=2)
    x, router, *_ = _local_inputs(num_experts=6, world=3)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by world_size=4"):
        EP.check_expert_parallel_inputs(x, router, *_local_inputs(num_experts=6, world=3)[2:], 1, world_size=4)


def test_layer_refuses_capacity_and_missing_process_group():
    with pytest.raises(ValueError, match="capacity_factor must be None"):
        EP.ExpertParallelMoE.from_moe(MoEFeedForward(HIDDEN, FFN, 4, 2, capacity_factor=1.25))
    with pytest.raises(TypeError, match="MoEFeedForward"):
        EP.ExpertParallelMoE.from_moe(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="needs a process group"):
        EP.ExpertParallelMoE(HIDDEN, FFN, 4, 2)
    with pytest.raises(RuntimeError, match="needs a process group"):
        EP.expert_parallel_moe(*_local_inputs(), 2)
    with pytest.raises(ValueError, match="impl"):
        EP.expert_parallel_moe(*_local_inputs(), 2, impl="cuda")
