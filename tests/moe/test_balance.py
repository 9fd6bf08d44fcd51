"""llmu.moe.balance: auxiliary-loss-free balancing (a per-expert bias on the top-k choice only)."""

from __future__ import annotations

import pytest
import torch

from llmu.moe import reference
from llmu.moe.balance import BiasBalancer
from llmu.moe.layer import MoEFeedForward
from llmu.moe.train import TinyMoEConfig, train


def _logits(t=32, e=8, seed=0):
    return torch.randn(t, e, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("renormalize", [True, False])
def test_without_a_bias_it_is_the_usual_top_k(renormalize):
    logits = _logits()
    weights, experts = BiasBalancer(1, 8, 2, renormalize=renormalize).select(0, logits)
    want_w, want_e, _ = reference.top_k_route(logits, 2, renormalize=renormalize)
    assert torch.equal(experts, want_e) and torch.equal(weights, want_w)


def test_the_bias_changes_the_choice_and_never_the_weights():
    logits = _logits()
    bal = BiasBalancer(2, 8, 2)
    bal.bias[1, 7] = 10.0                                    # expert 7 of layer 1: always chosen
    weights, experts = bal.select(1, logits)
    assert (experts == 7).any(dim=-1).all()
    probs = reference.router_probs(logits)
    chosen = probs.gather(-1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True), rtol=0, atol=0)
    assert torch.equal(bal.select(0, logits)[1], reference.top_k_route(logits, 2)[1])   # layer 0 unbiased


def test_the_gradient_reaches_the_logits_and_not_the_bias():
    logits = _logits().requires_grad_()
    bal = BiasBalancer(1, 8, 2, renormalize=False)
    bal.bias[0] = torch.linspace(-0.1, 0.1, 8)
    weights, _ = bal.select(0, logits)
    weights.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    assert not bal.bias.requires_grad


def test_update_walks_each_bias_by_the_rate_against_its_load():
    bal = BiasBalancer(2, 4, 1, rate=0.01)
    load = torch.tensor([[0.25, 0.25, 0.25, 0.25],          # balanced: no move
                         [0.70, 0.20, 0.05, 0.05]])          # over, under, under, under
    bal.update(load)
    torch.testing.assert_close(bal.bias, torch.tensor([[0.0, 0.0, 0.0, 0.0], [-0.01, 0.01, 0.01, 0.01]]))
    bal.update(torch.tensor([[0.25] * 4, [0.97, 0.01, 0.01, 0.01]]))     # the step is the sign, not the size
    torch.testing.assert_close(bal.bias[1], torch.tensor([-0.02, 0.02, 0.02, 0.02]))


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(num_layers=0), ValueError, "num_layers"), (dict(num_experts=2.5), TypeError, "num_experts"),
    (dict(k=9), ValueError, "k must be"), (dict(k=True), ValueError, "k must be"),
    (dict(rate=0), ValueError, "rate must be"), (dict(rate=float("nan")), ValueError, "rate must be"),
])
def test_bad_arguments_are_named(kwargs, exc, message):
    args = dict(num_layers=2, num_experts=8, k=2) | kwargs
    with pytest.raises(exc, match=message):
        BiasBalancer(**args)


def test_update_refuses_a_load_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"load must be a tensor of shape \(num_layers, E\) = \(2, 8\), got \(8,\)"):
        BiasBalancer(2, 8, 2).update(torch.full((8,), 0.125))


def test_a_layer_chooses_through_select_and_its_answer_is_checked():
    layer = MoEFeedForward(16, 32, 8, 2, impl="torch")
    x = torch.randn(10, 16)
    bal = BiasBalancer(1, 8, 2)
    bal.bias[0, 3] = 5.0
    layer.select = lambda logits: bal.select(0, logits)
    layer(x)
    assert (layer.last_aux.experts == 3).any(dim=-1).all()
    assert layer.last_aux.tokens_per_expert[3] == 10
    bad = {"one tensor": (lambda lg: lg, TypeError, "select must return"),
           "wrong shape": (lambda lg: (lg[:, :2], lg[:, :1].long()), ValueError, r"experts of shape \(10, 1\)"),
           "float experts": (lambda lg: (lg[:, :2], lg[:, :2]), TypeError, "int64"),
           "out of range": (lambda lg: (lg[:, :2], torch.full((10, 2), 8)), ValueError, "outside"),
           "twice": (lambda lg: (lg[:, :2], torch.zeros(10, 2, dtype=torch.int64)), ValueError, "same expert twice")}
    for select, exc, message in bad.values():
        layer.select = select
        with pytest.raises(exc, match=message):
            layer(x)


class _Recorder(BiasBalancer):
    """A balancer that records what the training loop hands it."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.layers_seen, self.loads = set(), []

    def select(self, layer, logits):
        self.layers_seen.add(layer)
        return super().select(layer, logits)

    def update(self, load):
        self.loads.append(load)
        super().update(load)


def test_train_routes_every_layer_through_the_balancer_and_updates_it_each_step():
    config = TinyMoEConfig(hidden=32, intermediate=32, num_layers=2, num_heads=2)
    rec = _Recorder(2, 8, 2, rate=0.01)
    run = train(aux_weight=0.0, steps=3, batch_size=2, seq_len=16, config=config, balancer=rec)
    assert rec.layers_seen == {0, 1} and len(rec.loads) == 3
    for load, recorded in zip(rec.loads, run.load):
        assert torch.equal(load, recorded)
    assert rec.bias.abs().sum() > 0 and run.settings["balancer"] == repr(rec)
    with pytest.raises(TypeError, match=r"balancer must have methods select\(layer, logits\) and update\(load\)"):
        train(steps=1, balancer=object())
