"""ZeRO stages 0-3 (llmu.parallel.zero) against the single process and FSDP2, on real gloo processes.

One ``launch`` per world size runs every check: for each stage, a tiny Llama trained with AdamW
on this rank's shard of a fixed global batch of 8 sequences, compared step by step with a
single-process copy trained on the whole batch; the memory each rank holds, against the formulas;
stage 3's gathers and frees; and FSDP2 (``fully_shard``) on the same model and shards.

Tolerances, float32 (the reasoning of test_data_parallel.py: ZeRO is data parallelism):
- this rank's gradient shard after ``reduce_gradients``, relative to the largest gradient:
  ``1e-6`` (the batch summed per shard and then across ranks: a few float32 roundings);
- parameters after each of 3 AdamW steps (lr 1e-2), absolute: ``3e-6``, about 12 ulps of a
  parameter near 1-2 (a rounding flip per step is possible; the largest error seen is 4.6e-7).
  AdamW updates element by element, so updating shards gives the unsharded update exactly.
- ZeRO-3 vs FSDP2: the same tolerance (both reduce-scatter the same gradients; seen: equal).
- memory: exact. The measured bytes are the padded formula's plus one 4-byte AdamW step counter
  per shard; the padded and unpadded formulas differ by less than 16 bytes x (W - 1) per unit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import llmu  # noqa: F401  (sets the Triton mode before anything imports triton)
from llmu.distributed import launch
from llmu.models import tiny_llama
from llmu.parallel import zero as Z
from llmu.parallel.data_parallel import next_token_loss, single_process_steps

GRAD_RTOL = 1e-6
PARAM_ATOL = 3e-6
STEPS, LR, BATCH, SEQ = 3, 1e-2, 8, 17


def _model(**overrides):
    return tiny_llama(0, **overrides).train().requires_grad_(True)


def _batch():
    return torch.randint(97, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _reference():
    return single_process_steps(_model(), _batch(), STEPS, LR)


def _flat_grad_shard(unit, grads):
    """The single process's gradient laid out as the unit's flat buffer, this rank's slice."""
    flat = torch.cat([grads[n].reshape(-1) for n in unit.names])
    flat = torch.cat([flat, flat.new_zeros(unit.padded - unit.numel)])
    return flat[unit.owned]


def _run_stage(rank, world, stage, ref_grads, ref_params):
    shard = _batch().chunk(world)[rank]
    model = _model()
    zero = Z.ZeRO(model, stage, lr=LR)
    # stage 3: what the parameters' storage holds while each unit runs its forward
    seen_in_forward = {}

    def record(unit):
        def hook(module, args, output):      # returns None: the output is left alone
            seen_in_forward.setdefault(unit.name, unit.params[0].untyped_storage().nbytes())
        return hook

    for u in zero.units:
        u.module.register_forward_hook(record(u), prepend=True)    # before ZeRO's own hook frees them
    out = {"grad": 0.0, "params": []}
    for step in range(STEPS):
        zero.zero_grad()
        next_token_loss(zero, shard).backward()
        zero.reduce_gradients()
        if step == 0:
            out["grad"] = max(((u.shard.grad - _flat_grad_shard(u, ref_grads)).abs().max()
                               / max(ref_grads[n].abs().max() for n in u.names)).item() for u in zero.units)
        zero.step()
        out["events"] = list(zero.events)
        out["storage_after_step"] = [p.untyped_storage().nbytes() for u in zero.units for p in u.params]
        out["memory"] = zero.memory()
        full = zero.full_parameters()
        out["params"].append(max((full[n] - ref_params[step][n]).abs().max().item() for n in full))
    out.update(peak=dict(zero.peak), final=full, seen_in_forward=seen_in_forward,
               units=[(u.name, u.numel, u.padded) for u in zero.units], num_params=zero.num_params,
               padded_params=zero.padded_params, shard_bytes=sum(u.shard.numel() * 4 for u in zero.units))
    return out


def _run_all(rank, world):
    ref_grads, ref_params = _reference()
    stages = {stage: _run_stage(rank, world, stage, ref_grads, ref_params) for stage in Z.STAGES}
    fsdp = Z.fsdp2_train(_model(), [_batch().chunk(world)[rank]] * STEPS, lr=LR)
    fsdp_vs_zero3 = max((fsdp[n] - stages[3]["final"][n]).abs().max().item() for n in fsdp)
    demo = Z.demo(rank, world, 1, stages=(3,), fsdp2=False) if world == 2 else None   # the notebook's entry
    return {"rank": rank, "world": dist.get_world_size(), "stages": stages, "fsdp_vs_zero3": fsdp_vs_zero3,
            "demo": demo}


@pytest.mark.parametrize("world", [2, 4])
def test_zero_equals_single_process_and_fsdp2(world):
    results = launch(_run_all, world)
    assert [(r["rank"], r["world"]) for r in results] == [(i, world) for i in range(world)]
    problems = []
    for rank, r in enumerate(results):
        for stage, got in r["stages"].items():
            if not got["grad"] <= GRAD_RTOL:
                problems.append(f"stage {stage}, rank {rank}: gradient shard relative error {got['grad']:.3g}")
            if not all(e <= PARAM_ATOL for e in got["params"]):
                problems.append(f"stage {stage}, rank {rank}: parameter errors per step {got['params']}")
        if not r["fsdp_vs_zero3"] <= PARAM_ATOL:
            problems.append(f"rank {rank}: ZeRO-3 and FSDP2 parameters differ by {r['fsdp_vs_zero3']:.3g}")
    assert not problems, "\n".join(problems)

    # memory: measured bytes == the float32 formula with the padded parameter count (+ step counters)
    for r in results:
        for stage, got in r["stages"].items():
            units = len(got["units"])
            padded = Z.zero_memory_formula(got["padded_params"], world, stage)
            exact = Z.zero_memory_formula(got["num_params"], world, stage)
            mem = got["memory"]
            assert mem["params"] == padded["params"] and mem["grads"] == padded["grads"], (stage, mem, padded)
            assert mem["optimizer"] == padded["optimizer"] + 4 * units, (stage, mem, padded)
            assert abs(padded["total"] - exact["total"]) <= 16 * (world - 1) * units
            assert got["peak"]["total"] >= mem["total"]

    # stage 3: gathered just in time, freed after use
    s3 = results[0]["stages"][3]
    unit_bytes = {name: padded * 4 for name, _, padded in s3["units"]}
    assert all(n == 0 for n in s3["storage_after_step"]), "stage 3 left gathered parameters behind"
    assert s3["memory"]["params"] == s3["shard_bytes"]
    assert s3["seen_in_forward"] == unit_bytes, "a unit ran its forward without its full parameters"
    names = [name for name, _, _ in s3["units"]]
    kinds = [(kind, name) for _, kind, name in s3["events"]]
    forward = [k for pair in zip([("gather (forward)", n) for n in names], [("free", n) for n in names]) for k in pair]
    assert kinds[:len(forward)] == forward, kinds
    assert [n for k, n in kinds[len(forward):] if k == "gather (backward)"] == names[::-1]
    # never the whole model at once: at most two units' full weights beside the shards
    assert s3["peak"]["params"] - s3["shard_bytes"] <= 2 * max(unit_bytes.values())
    assert s3["peak"]["params"] < results[0]["stages"][2]["memory"]["params"]

    if world == 2:
        demo = results[0]["demo"]
        assert set(demo["stages"]) == {3} and [row["stage"] for row in demo["table"]] == list(Z.STAGES)
        assert max(demo["stages"][3]["max_abs_error"]) <= PARAM_ATOL
        assert demo["table"][3]["measured_params"] == demo["stages"][3]["memory"]["params"]


# ---------------------------------------------------------------------------------------------
# formulas and bad input, no processes needed
# ---------------------------------------------------------------------------------------------


def test_formula_matches_the_paper():
    """Figure 1 of the ZeRO paper: Ψ = 7.5B, N = 64, mixed precision (K = 12):
    120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device."""
    psi = 7_500_000_000
    totals = [Z.zero_memory_formula(psi, 64, stage, "mixed")["total"] / 1e9 for stage in Z.STAGES]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    fp32 = Z.zero_memory_formula(psi, 64, 0)
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4 * psi, 4 * psi, 8 * psi)
    rows = Z.memory_table(1000, 4, measured={3: {"params": 1, "grads": 2, "optimizer": 3, "total": 6}})
    assert [row["stage"] for row in rows] == [0, 1, 2, 3]
    assert rows[3]["total"] == 16 * 1000 / 4 and rows[3]["measured_total"] == 6 and "measured_total" not in rows[0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_params=0, world_size=2, stage=1), "num_params"),
    (dict(num_params=10, world_size=2.0, stage=1), "world_size"),
    (dict(num_params=10, world_size=2, stage=4), "stage"),
    (dict(num_params=10, world_size=2, stage=1, precision="fp8"), "precision"),
])
def test_formula_refuses_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Z.zero_memory_formula(**kwargs)


def test_default_units_open_containers():
    assert [name for name, _ in Z.default_units(_model())] == ["embed_tokens", "layers.0", "layers.1", "norm",
                                                                "lm_head"]


def test_zero_refuses_bad_input():
    with pytest.raises(ValueError, match="stage must be one of"):
        Z.ZeRO(_model(), 4)
    with pytest.raises(ValueError, match="stage must be one of"):
        Z.ZeRO(_model(), True)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        Z.ZeRO("model", 1)
    with pytest.raises(ValueError, match="exactly one unit"):           # tied embedding and LM head
        Z.ZeRO(_model(tie_word_embeddings=True), 3)
    with pytest.raises(TypeError, match="float32"):
        Z.ZeRO(_model().double(), 1)
    with pytest.raises(ValueError, match="no parameter with requires_grad"):
        Z.ZeRO(tiny_llama(0), 1)
    with pytest.raises(ValueError, match="submodules of module"):
        Z.ZeRO(_model(), 1, units=[torch.nn.Linear(2, 2)])
    with pytest.raises(RuntimeError, match="needs a process group"):
        Z.ZeRO(_model(), 1)


def _zeroing_styles(rank, world):
    """Parameters after STEPS steps, per stage and per way of clearing gradients between steps."""
    styles = {
        "zero.zero_grad()": lambda zero: zero.zero_grad(),
        # PyTorch's idiom on the wrapped optimizer: the shards' gradients become None (= zero)
        "optimizer.zero_grad(set_to_none=True)": lambda zero: zero.optimizer.zero_grad(set_to_none=True),
        "both, optimizer first": lambda zero: (zero.optimizer.zero_grad(set_to_none=True), zero.zero_grad()),
    }
    shard = _batch().chunk(world)[rank]
    out = {}
    for stage in Z.STAGES:
        for style, clear in styles.items():
            model = _model()
            zero = Z.ZeRO(model, stage, lr=LR)
            for _ in range(STEPS):
                clear(zero)
                next_token_loss(zero, shard).backward()
                zero.step()
            zero.reduce_gradients()
            out[(stage, style)] = torch.cat([u.shard.detach().reshape(-1).clone() for u in zero.units])
    return out


def test_a_gradient_set_to_none_counts_as_zero():
    results = launch(_zeroing_styles, 2)
    for out in results:
        for stage in Z.STAGES:
            want = out[(stage, "zero.zero_grad()")]
            for style in ("optimizer.zero_grad(set_to_none=True)", "both, optimizer first"):
                # the same gradients summed in the same order: the same parameters, bit for bit
                assert torch.equal(out[(stage, style)], want), f"stage {stage}, {style}"
