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

Bit for bit on 3 and 4 ranks: every stage, and ShardedOptimizer, against one process
accumulating the same micro-batches (the gradients summed in rank order by default); the
backend's own order (``reduce_order="collective"``) stays within the tolerance above.

Then, on 2 ranks and bit for bit (``torch.equal``) against one process doing the ranks' own
arithmetic (see the comment above ``_by_hand``): SGD with momentum, Adam and AdamW in every stage;
an optimizer built over ``zero.parameters()`` (the shards) in every stage, and one over the
module's own parameters refused; mixed precision (bf16 in every stage, fp16 in stages 1 and 3)
against casting the float32 masters to the compute dtype by hand, with ``full_gradients()`` equal
on both ranks and the memory each rank holds against napkin math.

And on 3 ranks, what one step puts on the wire, counted by wrapping the collectives inside the
ranks: stage 1 reduce-scatters the gradients and all-gathers the weights (no all-reduce), and
stages 0-2 send the bytes of data parallelism's all-reduce, ``2(N - 1)/N · 4Ψ`` with ``Ψ`` padded;
stage 3 sends 1.5 times that; ShardedOptimizer what stage 1 sends.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
import torch.distributed as dist

import llmu  # noqa: F401  (sets the Triton mode before anything imports triton)
from llmu.distributed import launch
from llmu.models import tiny_llama
from llmu.parallel import sharded_optimizer, zero as Z
from llmu.parallel.data_parallel import accumulated_steps, next_token_loss, single_process_steps
from llmu.parallel.sharded_optimizer import ShardedOptimizer

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
        assert demo["stages"][3]["bit_exact"] == [True], demo["stages"][3]["bit_exact"]
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


# ---------------------------------------------------------------------------------------------
# any optimizer, optimizers over zero.parameters(), mixed precision: 2 ranks, compared bit for bit
# ---------------------------------------------------------------------------------------------
#
# The reference below does the ranks' own arithmetic in one process: each rank's micro-batch
# through the same model, the two gradients summed and halved in float32 (with two ranks the
# all-reduce and the reduce-scatter compute g0 + g1, whose value does not depend on the order, and
# halving is exact), then the plain optimizer on whole tensors. Element-wise optimizers round each
# element the same way in a flat slice as in its parameter, so every comparison is torch.equal.

OPTIMIZERS = {
    "SGD, momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "Adam": (torch.optim.Adam, {"lr": LR, "weight_decay": 0.1}),
    # ZeRO's default class, given the keywords its callers have always passed
    "AdamW": (torch.optim.AdamW, {"lr": LR, "betas": (0.9, 0.99), "eps": 1e-7, "weight_decay": 0.05}),
}


def _by_hand(batches, cls, kwargs, steps, compute_dtype=torch.float32):
    """What the ranks compute, in one process: float32 master weights; per step, each rank's
    micro-batch through the model with the masters cast to ``compute_dtype``, its gradient upcast
    to float32, the sum in rank order divided by the number of ranks, and the plain optimizer on
    the masters. Returns the masters after every step and the first step's average gradients."""
    model = _model()
    master = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    opt = cls(list(master.values()), **kwargs)
    history, first = [], None
    for _ in range(steps):
        grads = []
        for ids in batches:
            for n, p in model.named_parameters():
                p.data = master[n].detach().to(compute_dtype, copy=True)
            model.zero_grad(set_to_none=True)
            next_token_loss(model, ids).backward()
            grads.append({n: p.grad.float() for n, p in model.named_parameters()})
        for n, t in master.items():
            total = grads[0][n]
            for g in grads[1:]:
                total = total + g[n]
            t.grad = total / len(batches)
        if first is None:
            first = {n: t.grad.clone() for n, t in master.items()}
        opt.step()
        history.append({n: t.detach().clone() for n, t in master.items()})
    return history, first


def _differ(got: dict, want: dict) -> list[str]:
    return [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]


def _zero(stage, cls, kwargs, **extra):
    if cls is torch.optim.AdamW:                       # the default class, as existing callers use it
        return Z.ZeRO(_model(), stage, **kwargs, **extra)
    return Z.ZeRO(_model(), stage, cls, **kwargs, **extra)


def _any_optimizer(rank, world):
    batches = _batch().chunk(world)
    out = {"zero.step": {}, "optimizer over zero.parameters()": {}, "refused": {}, "sharded twice": []}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        history, _ = _by_hand(batches, cls, kwargs, STEPS)
        for stage in Z.STAGES:
            zero = _zero(stage, cls, kwargs)
            assert type(zero.optimizer) is cls
            diffs = []
            for step in range(STEPS):
                zero.zero_grad()
                next_token_loss(zero, batches[rank]).backward()
                zero.step()
                diffs.append(_differ(zero.full_parameters(), history[step]))
            out["zero.step"][name, stage] = diffs

    # FSDP2 with the same optimizers: close to the unsharded one (its own reduction; seen: equal)
    out["fsdp2"] = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        history, _ = _by_hand(batches, cls, kwargs, STEPS)
        got = Z.fsdp2_train(_model(), [batches[rank]] * STEPS, optimizer_cls=cls, **kwargs)
        out["fsdp2"][name] = max((got[n] - history[-1][n]).abs().max().item() for n in got)

    # PyTorch's idiom: an optimizer built over the wrapper's parameters (the shards), cleared either way
    cls, kwargs = OPTIMIZERS["SGD, momentum"]
    history, _ = _by_hand(batches, cls, kwargs, STEPS)
    for stage in Z.STAGES:
        for set_to_none in (True, False):
            zero = Z.ZeRO(_model(), stage)
            shards = list(zero.parameters())
            assert [s is u.shard for s, u in zip(shards, zero.units)] == [True] * len(zero.units)
            assert [n for n, _ in zero.named_parameters()][-1] == "lm_head.flat_shard"
            before = zero.full_parameters()
            opt = cls(zero.parameters(), **kwargs)
            diffs = []
            for step in range(STEPS):
                opt.zero_grad(set_to_none=set_to_none)
                next_token_loss(zero, batches[rank]).backward()
                opt.step()
                diffs.append(_differ(zero.full_parameters(), history[step]))
            after = zero.full_parameters()
            out["optimizer over zero.parameters()"][stage, set_to_none] = {
                "diffs": diffs, "all_moved": all(not torch.equal(before[n], after[n]) for n in before),
                "shard_sizes": [s.numel() for s in shards], "padded": [u.padded for u in zero.units]}
        # the module's own parameters are views whose gradients never stay: an optimizer over them is refused
        zero = Z.ZeRO(_model(), stage)
        opt = torch.optim.SGD(zero.module.parameters(), lr=0.1)
        next_token_loss(zero, batches[rank]).backward()
        try:
            opt.step()
            out["refused"][stage] = None
        except RuntimeError as e:
            out["refused"][stage] = str(e)
        zero.reduce_gradients()                         # every rank completes the collectives of this backward
        if stage == 1:                                  # a parameter lives in one flat buffer only
            for again in (lambda: ShardedOptimizer(zero.parameters(), torch.optim.SGD, lr=0.1),  # noqa: B023
                          lambda: Z.ZeRO(zero.module, 2)):                                     # noqa: B023
                try:
                    again()
                    out["sharded twice"].append(None)
                except ValueError as e:
                    out["sharded twice"].append(str(e))
    return out


def test_zero_with_any_optimizer_equals_the_unsharded_one():
    results = launch(_any_optimizer, 2)
    problems = []
    for rank, out in enumerate(results):
        for (name, stage), diffs in out["zero.step"].items():
            if any(diffs):
                problems.append(f"rank {rank}, {name}, stage {stage}: parameters differ per step: {diffs}")
        for (stage, set_to_none), got in out["optimizer over zero.parameters()"].items():
            where = f"rank {rank}, stage {stage}, optimizer over zero.parameters(), set_to_none={set_to_none}"
            if any(got["diffs"]):
                problems.append(f"{where}: parameters differ per step: {got['diffs']}")
            if not got["all_moved"]:                     # what an optimizer over the emptied views did before
                problems.append(f"{where}: some parameters did not move")
            want = [p if stage == 0 else p // 2 for p in got["padded"]]
            if got["shard_sizes"] != want:
                problems.append(f"{where}: shards of {got['shard_sizes']} elements, expected {want}")
        for stage, message in out["refused"].items():
            if message is None or "zero.parameters()" not in message:
                problems.append(f"rank {rank}, stage {stage}: an optimizer over the module's views was not refused "
                                f"({message})")
        for name, error in out["fsdp2"].items():
            if not error <= PARAM_ATOL:
                problems.append(f"rank {rank}: FSDP2 with {name} is {error:.3g} from the unsharded optimizer")
        if [m is not None and "already managed by a ZeRO" in m for m in out["sharded twice"]] != [True, True]:
            problems.append(f"rank {rank}: sharding ZeRO's tensors again was not refused: {out['sharded twice']}")
    assert not problems, "\n".join(problems)


def _mixed_precision(rank, world):
    batches = _batch().chunk(world)
    cls, kwargs = OPTIMIZERS["AdamW"]
    out = {}
    for dtype, stages in ((torch.bfloat16, Z.STAGES), (torch.float16, (1, 3))):
        history, first = _by_hand(batches, cls, kwargs, STEPS, dtype)
        for stage in stages:
            zero = _zero(stage, cls, kwargs, compute_dtype=dtype)
            seen = {}
            zero.module.register_forward_hook(lambda m, args, output, seen=seen: seen.update(
                logits=output.logits.dtype, weights={p.dtype for p in m.parameters()}))
            diffs = []
            for step in range(STEPS):
                zero.zero_grad()
                next_token_loss(zero, batches[rank]).backward()
                if step == 0:
                    grads = zero.full_gradients()
                    grad_diffs = _differ(grads, first)
                zero.step()
                if step == STEPS - 1:
                    memory = zero.memory()
                diffs.append(_differ(zero.full_parameters(), history[step]))
            out[dtype, stage] = {"diffs": diffs, "grad_diffs": grad_diffs, "grads": grads, "memory": memory,
                                 "padded": zero.padded_params, "units": len(zero.units), "seen": seen,
                                 "shard_dtypes": {p.dtype for p in zero.parameters()}}
    return out


def test_mixed_precision_equals_a_by_hand_reference():
    results = launch(_mixed_precision, 2)
    problems = []
    for rank, out in enumerate(results):
        for (dtype, stage), got in out.items():
            where = f"rank {rank}, {dtype}, stage {stage}"
            if any(got["diffs"]):
                problems.append(f"{where}: master weights differ per step: {got['diffs']}")
            if got["grad_diffs"]:
                problems.append(f"{where}: full_gradients() differ from the float32 average: {got['grad_diffs']}")
            if got["seen"] != {"logits": dtype, "weights": {dtype}} or got["shard_dtypes"] != {torch.float32}:
                problems.append(f"{where}: ran in {got['seen']}, shards {got['shard_dtypes']}")
            # napkin math, P padded parameters, 2 ranks, AdamW: compute weights 2 B, float32 gradients 4 B,
            # float32 master 4 B + moments 8 B (sharded from stage 1, gradients from stage 2, weights in stage 3)
            p, u, size = got["padded"], got["units"], {torch.bfloat16: 2, torch.float16: 2}[dtype]
            want = {"params": 0 if stage == 3 else size * p, "grads": 4 * p // (2 if stage >= 2 else 1),
                    "optimizer": 12 * p // (2 if stage >= 1 else 1) + 4 * u}
            if {k: got["memory"][k] for k in want} != want:
                problems.append(f"{where}: memory {got['memory']}, expected {want}")
    # the gradient of every (replicated) parameter is the same on both ranks, bit for bit
    for key, got in results[0].items():
        other = results[1][key]["grads"]
        assert not [n for n in got["grads"] if not torch.equal(got["grads"][n], other[n])], key
        assert all(g.dtype == torch.float32 for g in got["grads"].values())
    assert not problems, "\n".join(problems)


def test_zero_refuses_bad_optimizer_and_precision_arguments():
    model = _model()
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        Z.ZeRO(_model(), 1, "adamw")
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        Z.fsdp2_train(_model(), [], optimizer_cls="adamw")
    with pytest.raises(TypeError, match="not an optimizer built already"):
        Z.ZeRO(model, 1, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="cannot shard LBFGS"):
        Z.ZeRO(_model(), 1, torch.optim.LBFGS)
    with pytest.raises(ValueError, match="assume_elementwise=True"):
        Z.ZeRO(_model(), 1, type("MyAdam", (torch.optim.Adam,), {}))
    with pytest.raises(TypeError, match="SGD has no keyword argument 'betas'"):
        Z.ZeRO(_model(), 1, torch.optim.SGD, betas=(0.9, 0.99))
    with pytest.raises(TypeError, match="AdamW has no keyword argument 'lrr'"):
        Z.ZeRO(_model(), 1, lrr=1e-3)
    with pytest.raises(TypeError, match="not as params="):
        Z.ZeRO(_model(), 1, params=[])
    with pytest.raises(ValueError, match="Invalid learning rate"):
        Z.ZeRO(_model(), 1, lr=-1.0)
    with pytest.raises(TypeError, match="assume_elementwise must be True or False"):
        Z.ZeRO(_model(), 1, assume_elementwise=None)
    with pytest.raises(TypeError, match="compute_dtype must be a torch.dtype"):
        Z.ZeRO(_model(), 1, compute_dtype="bfloat16")
    for bad in (torch.float64, torch.int8, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="compute_dtype must be torch.bfloat16 or torch.float16"):
            Z.ZeRO(_model(), 1, compute_dtype=bad)
    with pytest.raises(TypeError, match="keep them float32 and pass compute_dtype"):
        Z.ZeRO(_model().bfloat16(), 1, compute_dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# bit-exact on any number of ranks: the gradients summed in rank order (llmu.parallel.ordered_reduce)
# ---------------------------------------------------------------------------------------------
#
# From 3 ranks on, the order in which a collective adds the ranks' gradients changes their last
# bits. ZeRO's default, reduce_order="rank", adds them as ((g0 + g1) + g2) + ..., the order of one
# process accumulating the same micro-batches; every stage then ends each step at parameters
# torch.equal to that process's (llmu.parallel.data_parallel.accumulated_steps: the sum, then / W).
# With 4 ranks the division by 4 is exact, so the plain accumulation loop, (loss / 4).backward()
# per micro-batch, matches too; with 3, dividing each micro-batch's loss by 3 first rounds
# differently, so that loop is not a reference there.

def _accumulating(batches, steps):
    """One process, AdamW (ZeRO's default), each step: ``(loss / W).backward()`` per micro-batch in
    order, then the update. Returns the parameters after every step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    history = []
    for _ in range(steps):
        for ids in batches:
            (next_token_loss(model, ids) / len(batches)).backward()
        opt.step()
        opt.zero_grad()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history


def _values_whose_sum_depends_on_order(rank, world, n):
    """Rank ``rank``'s input: large values of both signs and small ones, so that adding the
    ranks in another order changes the last bits of many elements."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 4, (n,), generator=g)


def _exact(rank, world):
    from llmu.parallel.ordered_reduce import all_reduce_in_rank_order, reduce_scatter_in_rank_order

    out = {}
    # the primitives, against the sum in rank order computed locally from every rank's input
    n = 6 * world
    inputs = [_values_whose_sum_depends_on_order(r, world, n) for r in range(world)]
    in_order, reversed_order = inputs[0].clone(), inputs[-1].clone()
    for x in inputs[1:]:
        in_order += x
    for x in inputs[-2::-1]:
        reversed_order += x
    mine = torch.empty(6)
    reduce_scatter_in_rank_order(mine, inputs[rank].clone())
    out["reduce_scatter"] = torch.equal(mine, in_order.view(world, 6)[rank])
    out["order_matters"] = not torch.equal(in_order, reversed_order)   # else this check could not fail
    odd = inputs[rank][:5 * world + 1].clone().view(-1, 1)               # not a multiple of the world size
    out["all_reduce"] = torch.equal(all_reduce_in_rank_order(odd).view(-1), in_order[:5 * world + 1])

    # training: 9 or 8 sequences, an equal share per rank, 3 AdamW steps
    batches = torch.randint(97, (3 * world if world % 2 else 2 * world, SEQ),
                            generator=torch.Generator().manual_seed(1)).chunk(world)
    by_hand = accumulated_steps(_model(), batches, STEPS, LR)
    accumulated = _accumulating(batches, STEPS) if world & (world - 1) == 0 else None
    for stage in Z.STAGES:
        zero = Z.ZeRO(_model(), stage, lr=LR)
        diffs = []
        for step in range(STEPS):
            zero.zero_grad()
            next_token_loss(zero, batches[rank]).backward()
            zero.step()
            full = zero.full_parameters()
            diffs.append((_differ(full, by_hand[step]), _differ(full, accumulated[step]) if accumulated else []))
        out["zero", stage] = diffs
    # ZeRO-1 without hooks: ShardedOptimizer over a plain model
    model = _model()
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    diffs = []
    for step in range(STEPS):
        next_token_loss(model, batches[rank]).backward()
        opt.step()
        opt.zero_grad()
        diffs.append(_differ(dict(model.named_parameters()), by_hand[step]))
    out["sharded optimizer"] = diffs
    # the backend's own order is still there, and close
    zero = Z.ZeRO(_model(), 3, lr=LR, reduce_order="collective")
    for _ in range(STEPS):
        zero.zero_grad()
        next_token_loss(zero, batches[rank]).backward()
        zero.step()
    out["collective error"] = max((zero.full_parameters()[n] - by_hand[-1][n]).abs().max().item() for n in by_hand[-1])
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_every_stage_is_bit_exact_on_any_number_of_ranks(world):
    results = launch(_exact, world)
    problems = []
    for rank, out in enumerate(results):
        for key in ("reduce_scatter", "all_reduce", "order_matters"):
            if not out[key]:
                problems.append(f"rank {rank}: {key} failed")
        for stage in Z.STAGES:
            for step, (vs_by_hand, vs_accumulated) in enumerate(out["zero", stage]):
                if vs_by_hand or vs_accumulated:
                    problems.append(f"rank {rank}, stage {stage}, step {step}: parameters differ from one process "
                                    f"(accumulated_steps: {vs_by_hand}; accumulating loss / W: {vs_accumulated})")
        if any(out["sharded optimizer"]):
            problems.append(f"rank {rank}: ShardedOptimizer differs per step: {out['sharded optimizer']}")
        if not out["collective error"] <= PARAM_ATOL:
            problems.append(f"rank {rank}: reduce_order='collective' is {out['collective error']:.3g} away")
    assert not problems, "\n".join(problems)


def test_reduce_order_is_checked():
    with pytest.raises(ValueError, match="reduce_order must be one of"):
        Z.ZeRO(_model(), 1, reduce_order="ring")
    with pytest.raises(ValueError, match="reduce_order must be one of"):
        ShardedOptimizer(_model().parameters(), torch.optim.SGD, lr=0.1, reduce_order=None)


# ---------------------------------------------------------------------------------------------
# what a step puts on the wire: stages 1 and 2 send the bytes of plain data parallelism
# ---------------------------------------------------------------------------------------------
#
# ZeRO's stage 1 (Rajbhandari et al. 2020, P_os) reduce-scatters the gradients (each rank receives
# the sum of its own slice), updates that slice and all-gathers the parameters: a ring all-reduce
# cut in two around the update, 2(N - 1)/N · 4Ψ bytes sent per rank in float32 (Ψ padded), exactly
# what data parallelism's all-reduce sends. All-reducing the whole gradient and then all-gathering
# the parameters would send 3(N - 1)/N · 4Ψ. Stage 2 sends what stage 1 sends; stage 3 gathers each
# unit's weights twice (before its forward and before its backward): 3(N - 1)/N · 4Ψ.

#: Bytes one rank sends in one step, in units of (N - 1)/N of the padded float32 model (4Ψ).
WIRE_SHARES = {0: 2, 1: 2, 2: 2, 3: 3}

#: The collectives a step issues, per unit of ZeRO (per parameter group of ShardedOptimizer).
CALLS_PER_UNIT = {0: {"all-reduce": 1}, 1: {"reduce-scatter": 1, "all-gather": 1},
                  2: {"reduce-scatter": 1, "all-gather": 1}, 3: {"reduce-scatter": 1, "all-gather": 2}}


@contextlib.contextmanager
def _collectives(module):
    """Count, in this process, the collectives issued while the block runs. ``calls``: those
    ``module`` (zero.py or sharded_optimizer.py) calls itself, ``"all-reduce"``, ``"reduce-scatter"``
    or ``"all-gather"``. ``sent``: the bytes this rank puts on the wire in the torch.distributed
    primitives underneath, as a bandwidth-optimal ring or all-to-all sends them: (N - 1)/N of the
    whole buffer for a reduce-scatter, an all-gather or an all-to-all, twice that for an all-reduce."""
    from llmu.parallel import ordered_reduce

    world = dist.get_world_size()
    calls, sent, undo = [], [], []

    def share(t):
        return t.numel() * t.element_size() * (world - 1) // world

    def wrap(owner, name, kind, wire=None):
        if not hasattr(owner, name):
            return
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if kind is not None:
                calls.append(kind)
            if wire is not None:
                sent.append(wire(*args))
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        undo.append((owner, name, original))

    wrap(module, "reduce_scatter_in_rank_order", "reduce-scatter")   # its all-to-all is counted below
    wrap(module, "all_reduce_in_rank_order", "all-reduce")           # an all-to-all and an all-gather below
    wrap(module, "_reduce_scatter", "reduce-scatter", lambda out, full, *rest: share(full))
    wrap(module, "_all_gather", "all-gather", lambda full, mine, *rest: share(full))
    wrap(dist, "all_reduce", "all-reduce", lambda t, *rest: 2 * share(t))
    wrap(dist, "all_to_all_single", None, lambda out, full, *rest: share(full))
    wrap(ordered_reduce, "_all_gather", None, lambda full, mine, *rest: share(full))
    try:
        yield calls, sent
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


#: A tiny Llama whose units are not multiples of 3 long: on 3 ranks every flat buffer is padded.
PADDED_MODEL = {"hidden_size": 40}


def _on_the_wire(rank, world):
    shard = _batch().chunk(world)[rank]
    out = {}
    for order in ("rank", "collective"):
        for stage in Z.STAGES:
            zero = Z.ZeRO(_model(**PADDED_MODEL), stage, lr=LR, reduce_order=order)
            with _collectives(Z) as (calls, sent):
                next_token_loss(zero, shard).backward()
                zero.step()
            out[order, stage] = {"calls": collections.Counter(calls), "sent": sum(sent),
                                 "padded": zero.padded_params, "units": len(zero.units), "numel": zero.num_params}
    model = _model(**PADDED_MODEL)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    with _collectives(sharded_optimizer) as (calls, sent):
        next_token_loss(model, shard).backward()
        opt.step()
    out["ShardedOptimizer"] = {"calls": collections.Counter(calls), "sent": sum(sent),
                               "padded": sum(fg.padded for fg in opt.flat_groups), "units": len(opt.flat_groups)}

    # gradients that arrive after a reduction (full_gradients() read half-way through an accumulation)
    # are added to its result: stage 1 ends where stage 2 does, bit for bit
    ids = torch.randint(97, (2 * world, SEQ), generator=torch.Generator().manual_seed(2))
    final = {}
    for stage in (1, 2):
        zero = Z.ZeRO(_model(), stage, lr=LR)
        for _ in range(2):
            zero.zero_grad()
            next_token_loss(zero, ids[rank:rank + 1]).backward()
            zero.full_gradients()
            next_token_loss(zero, ids[world + rank:world + rank + 1]).backward()
            zero.step()
        final[stage] = zero.full_parameters()
    out["stage 1 vs 2, accumulating after a reduction"] = _differ(final[1], final[2])
    return out


@pytest.fixture(scope="module")
def on_the_wire():
    return launch(_on_the_wire, 3)        # 3 ranks: (N - 1)/N is not 1/2, and every unit is padded


def test_stage_1_sends_the_bytes_of_data_parallelism(on_the_wire):
    world = len(on_the_wire)
    problems = []
    for rank, out in enumerate(on_the_wire):
        assert out["rank", 0]["padded"] == out["rank", 0]["numel"] + 2 * out["rank", 0]["units"], "padding"
        for key, got in out.items():
            if not isinstance(got, dict):
                continue
            stage = 1 if key == "ShardedOptimizer" else key[1]
            where = f"rank {rank}, {key if key == 'ShardedOptimizer' else f'stage {stage}, reduce_order={key[0]!r}'}"
            want_calls = {kind: n * got["units"] for kind, n in CALLS_PER_UNIT[stage].items()}
            if dict(got["calls"]) != want_calls:
                problems.append(f"{where}: issued {dict(got['calls'])}, expected {want_calls}")
            # (N - 1)/N of 4 bytes per padded parameter, per share; every unit is a multiple of N long
            want_bytes = WIRE_SHARES[stage] * 4 * got["padded"] * (world - 1) // world
            if got["sent"] != want_bytes:
                problems.append(f"{where}: sent {got['sent']} bytes, expected {want_bytes} "
                                f"({WIRE_SHARES[stage]} x (N - 1)/N x 4 bytes x {got['padded']} padded parameters)")
    # data parallelism's all-reduce volume, the same in stages 0, 1 and 2
    sent = {stage: on_the_wire[0]["rank", stage]["sent"] for stage in Z.STAGES}
    if not (sent[0] == sent[1] == sent[2] and 2 * sent[3] == 3 * sent[0]):
        problems.append(f"bytes sent per stage {sent}: stages 0-2 should send the same, stage 3 1.5 times that")
    assert not problems, "\n".join(problems)


def test_stage_1_accumulates_gradients_after_a_reduction(on_the_wire):
    for rank, out in enumerate(on_the_wire):
        assert not out["stage 1 vs 2, accumulating after a reduction"], rank


# ---------------------------------------------------------------------------------------------
# checkpoints: state_dict() is the single process's, load_state_dict() takes it back
# ---------------------------------------------------------------------------------------------

def _checkpoints(rank, world):
    batches = _batch().chunk(world)
    out = {}
    for stage, dtype in [(s, None) for s in Z.STAGES] + [(1, torch.bfloat16), (3, torch.bfloat16)]:
        zero = Z.ZeRO(_model(), stage, lr=LR, compute_dtype=dtype)
        for _ in range(2):
            zero.zero_grad()
            next_token_loss(zero, batches[rank]).backward()
            zero.step()
        sd = zero.state_dict()
        full = zero.full_parameters()
        plain = _model()                                   # one process, loads the checkpoint as it is
        plain.load_state_dict(sd)
        fresh = Z.ZeRO(tiny_llama(7).train().requires_grad_(True), stage, lr=LR, compute_dtype=dtype)
        fresh.load_state_dict(sd)
        probe = batches[0][:1]
        with torch.no_grad():
            got, want = fresh(probe).logits.float(), zero(probe).logits.float()
        out[stage, dtype] = {
            "keys": list(sd) == list(_model().state_dict()),
            "trained_full_float32": not _differ({n: sd[n] for n in full}, full),
            "plain_equal": not _differ(dict(plain.named_parameters()), full),
            "fresh_equal": not _differ(fresh.full_parameters(), full),
            "same_output": torch.equal(got, want),
        }
    try:
        Z.ZeRO(_model(), 2, lr=LR).load_state_dict({k: v for k, v in sd.items() if k != "norm.weight"})
        out["strict"] = None
    except RuntimeError as e:
        out["strict"] = str(e)
    return out


def test_state_dict_is_the_single_process_one_and_loads_back():
    results = launch(_checkpoints, 2)
    problems = [f"rank {rank}, {key}: {name}" for rank, out in enumerate(results) for key, checks in out.items()
                if key != "strict" for name, ok in checks.items() if not ok]
    assert not problems, "\n".join(problems)
    assert all(out["strict"] and "missing keys ['norm.weight']" in out["strict"] for out in results)
