"""ShardedOptimizer (llmu.parallel.sharded_optimizer), ZeRO-1 for any element-wise optimizer, on
real gloo processes, against the plain optimizer in one process.

Exactness. The reference is built to do the same arithmetic as the two ranks: in one process,
each rank's micro-batch gradient is computed by the same model, the two are summed and halved in
float32, and the plain ``torch.optim`` optimizer steps the whole parameters. With two ranks the
reduce-scatter's sum is ``g0 + g1`` (a sum of two floats does not depend on the order), and the
division by 2 is exact, so the sharded run sees the same gradients bit for bit. SGD (with
momentum), Adam and AdamW update each element from that element alone, and PyTorch's element-wise
kernels round every element the same way whatever its position in the tensor, so updating flat
slices gives the same bits as updating the parameters: every comparison below is ``torch.equal``.
(Against one process that computes the gradient of the whole batch at once, the gradients differ
by a few float32 roundings, because the batch is summed in another grouping: that comparison, with
its tolerance, is in test_zero.py.)
"""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401  (sets the Triton mode before anything imports triton)
from llmu.distributed import launch
from llmu.models import tiny_llama
from llmu.parallel.data_parallel import DataParallel, next_token_loss
from llmu.parallel.sharded_optimizer import ShardedOptimizer, check_optimizer_class

STEPS, BATCH, SEQ = 3, 4, 17

#: name: (optimizer class, keyword arguments, zero_grad(set_to_none=...))
CASES = {
    "SGD, momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, False),
    "Adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}, True),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2}, True),
}


def _model():
    return tiny_llama(0).train().requires_grad_(True)


def _batches(world):
    ids = torch.randint(97, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids.chunk(world)


def _groups(model, lr):
    """Two parameter groups: matrices with weight decay, norm gains (1-D) without and at half the lr."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() > 1]},
            {"params": [p for _, p in named if p.dim() == 1], "weight_decay": 0.0, "lr": lr / 2}]


def _by_hand(model, batches, optimizer_cls, kwargs, steps, grouped=False, scheduler=False):
    """One process doing the ranks' arithmetic: per step, the gradient of each micro-batch, summed
    in rank order and divided by the number of ranks, then the plain optimizer. Returns the
    parameters after every step and the optimizer."""
    params = dict(model.named_parameters())
    opt = optimizer_cls(_groups(model, kwargs["lr"]) if grouped else list(params.values()), **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if scheduler else None
    history = []
    for _ in range(steps):
        grads = []
        for ids in batches:
            model.zero_grad(set_to_none=True)
            next_token_loss(model, ids).backward()
            grads.append({n: p.grad.clone() for n, p in params.items()})
        for n, p in params.items():
            total = grads[0][n]
            for g in grads[1:]:
                total = total + g[n]
            p.grad = total / len(batches)
        opt.step()
        if sched is not None:
            sched.step()
        history.append({n: p.detach().clone() for n, p in params.items()})
    return history, opt


def _same(a: dict, b: dict) -> list[str]:
    return [n for n in a if not torch.equal(a[n], b[n])]


def _same_state(a: dict, b: dict) -> bool:
    """Two optimizer state dicts hold the same values (tensors bit for bit)."""
    if a["param_groups"] != b["param_groups"] or set(a["state"]) != set(b["state"]):
        return False
    for i, state in a["state"].items():
        other = b["state"][i]
        if set(state) != set(other):
            return False
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if not torch.equal(value, other[key]):
                    return False
            elif value != other[key]:
                return False
    return True


def _run(rank, world):
    batches = _batches(world)
    out = {}
    for name, (cls, kwargs, set_to_none) in CASES.items():
        grouped = scheduler = name == "AdamW"           # parameter groups and an LR scheduler too
        history, _ = _by_hand(_model(), batches, cls, kwargs, STEPS + 1, grouped, scheduler)
        model = _model()
        opt = ShardedOptimizer(_groups(model, kwargs["lr"]) if grouped else model.parameters(), cls, **kwargs)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if scheduler else None
        params = dict(model.named_parameters())
        errors = []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=set_to_none)
            next_token_loss(model, batches[rank]).backward()
            opt.step()
            if sched is not None:
                sched.step()
            errors.append(_same({n: p.detach() for n, p in params.items()}, history[step]))
        state = opt.state_dict()                        # a collective, the plain optimizer's layout
        # A plain optimizer after the same steps has the same state
        _, plain_after = _by_hand(_model(), batches, cls, kwargs, STEPS, grouped, scheduler)
        same_state = _same_state(state, plain_after.state_dict())
        # The plain optimizer's state loads into a new sharded optimizer, which then steps on as it would
        fresh = _model()
        with torch.no_grad():
            for n, p in fresh.named_parameters():
                p.copy_(history[STEPS - 1][n])
        resumed = ShardedOptimizer(_groups(fresh, kwargs["lr"]) if grouped else fresh.parameters(), cls, **kwargs)
        resumed.load_state_dict(plain_after.state_dict())
        resumed.zero_grad()
        next_token_loss(fresh, batches[rank]).backward()
        resumed.step()
        errors_resumed = _same({n: p.detach() for n, p in fresh.named_parameters()}, history[STEPS])
        padded = sum(fg.padded for fg in opt.flat_groups)
        out[name] = {"errors": errors, "same_state": same_state, "errors_resumed": errors_resumed,
                     "state_bytes": opt.state_bytes(), "padded": padded, "groups": len(opt.flat_groups),
                     "lrs": [g["lr"] for g in opt.optimizer.param_groups],
                     "plain_lrs": [g["lr"] for g in plain_after.param_groups]}

    # average_gradients=False behind DataParallel, which averages the gradients itself
    cls, kwargs, _ = CASES["SGD, momentum"]
    history, _ = _by_hand(_model(), batches, cls, kwargs, STEPS)
    model = _model()
    dp = DataParallel(model)
    opt = ShardedOptimizer(model.parameters(), cls, average_gradients=False, **kwargs)
    errors = []
    for step in range(STEPS):
        opt.zero_grad()
        next_token_loss(dp, batches[rank]).backward()
        dp.finish()
        opt.step()
        errors.append(_same({n: p.detach() for n, p in model.named_parameters()}, history[step]))
    out["behind DataParallel"] = {"errors": errors}
    return out


def test_sharded_optimizer_equals_the_plain_optimizer():
    results = launch(_run, 2)
    for rank, out in enumerate(results):
        for name, got in out.items():
            assert all(not bad for bad in got["errors"]), (rank, name, got["errors"])
            if name == "behind DataParallel":
                continue
            assert got["same_state"], f"{name}: state_dict() differs from the plain optimizer's"
            assert not got["errors_resumed"], f"{name}: a step after load_state_dict differs: {got['errors_resumed']}"
            # napkin math: this rank's slice of the padded parameters, 4 bytes per element per state tensor
            per_element = {"SGD, momentum": 1, "Adam": 2, "AdamW": 2}[name]
            step_counters = 0 if name.startswith("SGD") else 4 * got["groups"]
            assert got["state_bytes"] == 4 * per_element * got["padded"] // 2 + step_counters, (name, got)
        assert out["AdamW"]["lrs"] == out["AdamW"]["plain_lrs"] == [1e-2 / 8, 1e-2 / 16]   # StepLR reached them
    assert results[0]["AdamW"]["state_bytes"] == results[1]["AdamW"]["state_bytes"]


# ---------------------------------------------------------------------------------------------
# bad input, no processes needed (every check comes before the first collective)
# ---------------------------------------------------------------------------------------------


class _MySGD(torch.optim.SGD):
    pass


@pytest.mark.parametrize("cls, kwargs, error, match", [
    ("SGD", {}, TypeError, "torch.optim.Optimizer subclass"),
    (torch.nn.Linear, {}, TypeError, "torch.optim.Optimizer subclass"),
    (torch.optim.LBFGS, {}, ValueError, "cannot shard LBFGS: it builds its search direction"),
    (torch.optim.Adafactor, {}, ValueError, "cannot shard Adafactor: it factors"),
    (torch.optim.SparseAdam, {}, ValueError, "cannot shard SparseAdam"),
    (_MySGD, {}, ValueError, "assume_elementwise=True"),
    (ShardedOptimizer, {}, TypeError, "shards already"),
    (torch.optim.SGD, {"lrr": 0.1}, TypeError, "SGD has no keyword argument 'lrr'; it takes lr, momentum"),
    (torch.optim.SGD, {"betas": (0.9, 0.99)}, TypeError, "no keyword argument 'betas'"),
    (torch.optim.SGD, {"lr": -1.0}, ValueError, "Invalid learning rate"),
])
def test_refuses_optimizers_it_cannot_shard(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        ShardedOptimizer(_model().parameters(), cls, **kwargs)


def test_refuses_bad_input():
    model = _model()
    with pytest.raises(TypeError, match="not an optimizer built already"):
        ShardedOptimizer(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1))
    if hasattr(torch.optim, "Muon"):
        with pytest.raises(ValueError, match="cannot shard Muon"):
            check_optimizer_class(torch.optim.Muon, {})
    check_optimizer_class(_MySGD, {"lr": 0.1}, assume_elementwise=True)     # vouched for: accepted
    with pytest.raises(TypeError, match="assume_elementwise must be True or False"):
        ShardedOptimizer(model.parameters(), torch.optim.SGD, assume_elementwise="yes")
    with pytest.raises(TypeError, match="average_gradients must be True or False"):
        ShardedOptimizer(model.parameters(), torch.optim.SGD, average_gradients=1)
    with pytest.raises(ValueError, match="params is empty"):
        ShardedOptimizer([], torch.optim.SGD)
    with pytest.raises(TypeError, match="got a single tensor"):
        ShardedOptimizer(model.lm_head.weight, torch.optim.SGD)
    with pytest.raises(TypeError, match="ordered iterable"):
        ShardedOptimizer(set(model.parameters()), torch.optim.SGD)
    with pytest.raises(ValueError, match="requires_grad=False"):
        ShardedOptimizer(tiny_llama(0).parameters(), torch.optim.SGD)
    with pytest.raises(TypeError, match="floating-point"):
        ShardedOptimizer([torch.zeros(3, dtype=torch.long)], torch.optim.SGD)
    with pytest.raises(ValueError, match="given twice"):
        ShardedOptimizer([model.lm_head.weight, model.lm_head.weight], torch.optim.SGD)
    with pytest.raises(ValueError, match="one dtype and one device"):
        ShardedOptimizer([model.lm_head.weight, torch.zeros(3, dtype=torch.float64, requires_grad=True)],
                         torch.optim.SGD)
    with pytest.raises(RuntimeError, match="needs a process group"):
        ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
