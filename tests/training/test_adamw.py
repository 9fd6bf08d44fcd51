"""llmu.training.adamw.AdamW against torch.optim.AdamW (foreach=False: the single-tensor path).

Tolerance: none. llmu's AdamW performs torch's single-tensor operations in torch's order (decay,
lerp_ of m, mul_/addcmul_ of v, Python-float bias corrections, one addcdiv_), so each step gives
the same bits, and 1,000 steps of a model end with ``torch.equal`` weights and state. A test
that allowed a tolerance here would hide a changed order of operations, which drifts by ulps a step.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmu.models import byte_llama_config, make_trainable
from llmu.training.adamw import AdamW
from llmu.training.loop import adamw_param_groups, optimizer_state_memory

pytestmark = pytest.mark.usefixtures("one_thread")    # tests/training/conftest.py


def small_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 3))


def run_both(make_groups, steps: int, seed: int = 0, **hyper):
    """Train two copies of a small MLP on the same random regression batches, one with each
    optimizer; return (ours, torch's) models and optimizers."""
    mine, ref = small_mlp(seed), small_mlp(seed)
    opt_mine = AdamW(make_groups(mine), **hyper)
    opt_ref = torch.optim.AdamW(make_groups(ref), foreach=False, **hyper)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x, y = torch.randn(16, 7, generator=g), torch.randn(16, 3, generator=g)
        for model, opt in ((mine, opt_mine), (ref, opt_ref)):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return (mine, opt_mine), (ref, opt_ref)


def assert_same(a: torch.nn.Module, opt_a, b: torch.nn.Module, opt_b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), f"{name} differs by {(pa - pb).abs().max():.3g}"
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert set(sa) == set(sb) == {"step", "exp_avg", "exp_avg_sq"}
        for key in sa:
            assert torch.equal(sa[key], sb[key]), f"{name} state {key}"
            assert sa[key].dtype == sb[key].dtype


@pytest.mark.parametrize("hyper", [
    dict(lr=1e-3, weight_decay=0.0),
    dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95)),
    dict(lr=1e-2, weight_decay=0.5, betas=(0.8, 0.99), eps=1e-6),
], ids=["no-decay", "gpt3-betas", "strong-decay"])
def test_equals_torch_over_1000_steps(hyper):
    (mine, opt_mine), (ref, opt_ref) = run_both(lambda m: m.parameters(), 1000, **hyper)
    assert_same(mine, opt_mine, ref, opt_ref)


def test_param_groups_with_their_own_settings():
    def groups(m):
        return [{"params": [m[0].weight, m[2].weight], "weight_decay": 0.2, "lr": 2e-3},
                {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0, "betas": (0.5, 0.9)}]
    (mine, opt_mine), (ref, opt_ref) = run_both(groups, 300, lr=1e-3)
    assert_same(mine, opt_mine, ref, opt_ref)


def test_the_byte_llama_with_decay_groups():
    """The course's model with matrices decayed and vectors not, and a tied embedding: 50 steps."""
    config = byte_llama_config(32, 1, max_len=16, head_dim=8)
    mine, ref = make_trainable(config, seed=0), make_trainable(config, seed=0)
    opt_mine = AdamW(adamw_param_groups(mine, 0.1), lr=3e-3, betas=(0.9, 0.95))
    opt_ref = torch.optim.AdamW(adamw_param_groups(ref, 0.1), lr=3e-3, betas=(0.9, 0.95), foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        ids = torch.randint(0, 256, (2, 17), generator=g)
        for model, opt in ((mine, opt_mine), (ref, opt_ref)):
            opt.zero_grad(set_to_none=True)
            logits = model(ids[:, :-1]).logits
            torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1)).backward()
            opt.step()
    assert_same(mine, opt_mine, ref, opt_ref)
    assert optimizer_state_memory(opt_mine) == optimizer_state_memory(opt_ref)


def test_state_dict_round_trip_continues_exactly():
    """state_dict() from the base class: a fresh AdamW that loads it continues like the original,
    and torch's AdamW can load ours (same keys)."""
    (mine, opt_mine), _ = run_both(lambda m: m.parameters(), 20, weight_decay=0.1)
    twin = small_mlp(1)
    twin.load_state_dict(mine.state_dict())
    opt_copy = AdamW(twin.parameters(), weight_decay=0.1)
    opt_copy.load_state_dict(copy.deepcopy(opt_mine.state_dict()))   # a loaded dict shares its tensors
    opt_torch_model = small_mlp(2)
    opt_torch_model.load_state_dict(mine.state_dict())
    opt_torch = torch.optim.AdamW(opt_torch_model.parameters(), weight_decay=0.1, foreach=False)
    opt_torch.load_state_dict(copy.deepcopy(opt_mine.state_dict()))
    x, y = torch.randn(4, 7), torch.randn(4, 3)
    for model, opt in ((mine, opt_mine), (twin, opt_copy), (opt_torch_model, opt_torch)):
        for _ in range(5):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert_same(mine, opt_mine, twin, opt_copy)
    assert_same(mine, opt_mine, opt_torch_model, opt_torch)


def test_parameters_without_grad_are_left_alone():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = AdamW([a, b], lr=0.1, weight_decay=0.5)
    a.grad = torch.ones(3)
    opt.step()
    assert torch.equal(b, torch.ones(3)) and b not in opt.state     # not even decayed
    assert opt.state[a]["step"].item() == 1


def test_first_step_moves_by_lr():
    """Bias correction: at step 1, m̂ = g and v̂ = g², so each coordinate moves by lr (ε aside)."""
    w = torch.nn.Parameter(torch.zeros(4))
    opt = AdamW([w], lr=0.01, weight_decay=0.0, betas=(0.9, 0.999))
    w.grad = torch.tensor([1e-4, -3.0, 50.0, -0.2])
    opt.step()
    torch.testing.assert_close(w.detach(), -0.01 * torch.sign(w.grad), rtol=1e-3, atol=0)


def test_closure_returns_the_loss():
    w = torch.nn.Parameter(torch.ones(2))
    opt = AdamW([w])

    def closure():
        opt.zero_grad()
        loss = (w ** 2).sum()
        loss.backward()
        return loss
    assert opt.step(closure).item() == 2.0


def test_amsgrad_is_refused():
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW([torch.nn.Parameter(torch.ones(1))], amsgrad=True)
    opt = AdamW([torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))], "amsgrad": True})


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(lr=-1e-3), ValueError, "lr"),
    (dict(lr=float("nan")), ValueError, "lr"),
    (dict(lr="0.1"), TypeError, "lr"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(betas=(1.0, 0.999)), ValueError, r"betas\[0\]"),
    (dict(betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
    (dict(betas=(0.9,)), ValueError, "betas"),
    (dict(betas=(True, 0.9)), TypeError, r"betas\[0\]"),
])
def test_bad_hyperparameters_are_refused(kwargs, error, name):
    with pytest.raises(error, match=name):
        AdamW([torch.nn.Parameter(torch.ones(1))], **kwargs)


def test_a_bad_group_value_is_refused():
    with pytest.raises(ValueError, match="lr"):
        AdamW([{"params": [torch.nn.Parameter(torch.ones(1))], "lr": -1.0}])


def test_sparse_gradients_are_refused():
    w = torch.nn.Parameter(torch.ones(3))
    opt = AdamW([w])
    w.grad = torch.ones(3).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
