"""llmu.moe.train: the small byte-level MoE language model of notebook 12.

Short runs only (a few seconds each on one thread): the model trains (the loss falls), the
recorded loads are shares that sum to 1 per layer and step, a run is reproducible from its seed,
and the load-balancing weight changes how evenly the router spreads the token copies.
"""

from __future__ import annotations

import math

import pytest
import torch

import llmu  # noqa: F401
from llmu.data import byte_tokens
from llmu.moe import train as T

SMALL = T.TinyMoEConfig(hidden=32, num_layers=2, num_heads=2, intermediate=32, num_experts=4, k=2)


def test_forward_shapes_and_aux():
    model = T.TinyMoELM(SMALL)
    ids = torch.randint(0, 256, (3, 17))
    logits = model(ids)
    assert logits.shape == (3, 17, 256)
    aux = model.aux()
    assert len(aux) == 2 and all(a.experts.shape == (3 * 17, 2) for a in aux)
    assert all(int(a.tokens_per_expert.sum()) == 3 * 17 * 2 for a in aux)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = T.TinyMoELM(SMALL)
    ids = torch.randint(0, 256, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    with torch.no_grad():
        a, b = model(ids), model(changed)
    # top-k routing is per token, attention is causal: positions before 8 cannot see the change.
    # Not to the bit: each expert multiplies the rows it was sent as one matrix, and the changed
    # tokens change which rows share a matmul with the early ones (float32 ulps of O(1) logits).
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_training_records_loss_and_loads():
    run = T.train(aux_weight=0.01, steps=40, batch_size=8, seq_len=32, config=SMALL)
    assert run.loss.shape == (40,) and run.aux_loss.shape == (40,) and run.z_loss.shape == (40,)
    assert run.load.shape == (40, 2, 4)
    torch.testing.assert_close(run.load.sum(-1), torch.ones(40, 2))        # shares of the T*k copies
    assert (run.load >= 0).all()
    # from about ln(256) = 5.5 nats for an untrained model to clearly less
    assert run.loss[:3].mean() > 4.5 and run.loss[-5:].mean() < run.loss[:3].mean() - 1.0
    # E * sum f_i P_i is at least 1 in practice (exactly 1 at balance) and at most E
    assert (run.aux_loss > 0.9).all() and (run.aux_loss <= 4 + 1e-6).all()
    assert run.seconds > 0 and run.settings["aux_weight"] == 0.01
    assert run.final_load(5).shape == (2, 4)


def test_seeded_runs_are_reproducible():
    a = T.train(aux_weight=0.0, steps=5, batch_size=4, seq_len=16, config=SMALL, seed=3)
    b = T.train(aux_weight=0.0, steps=5, batch_size=4, seq_len=16, config=SMALL, seed=3)
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)
    torch.testing.assert_close(a.load, b.load, rtol=0, atol=0)


def test_aux_weight_balances_the_load():
    # the notebook's model, shortened: without the loss the router piles onto a few experts early
    kw = dict(steps=60, batch_size=16, seq_len=64)
    free = T.train(aux_weight=0.0, **kw)
    balanced = T.train(aux_weight=0.05, **kw)
    cv_free = T.load_stats(free.final_load())["cv"]
    cv_bal = T.load_stats(balanced.final_load())["cv"]
    assert (cv_bal < cv_free).all(), (cv_free, cv_bal)
    assert balanced.aux_loss[-10:].mean() < free.aux_loss[-10:].mean()


def test_z_loss_weight_shrinks_router_logits():
    kw = dict(steps=40, batch_size=8, seq_len=32, config=SMALL)
    plain = T.train(aux_weight=0.0, z_weight=0.0, **kw)
    squeezed = T.train(aux_weight=0.0, z_weight=1.0, **kw)
    assert squeezed.z_loss[-5:].mean() < plain.z_loss[-5:].mean()


def test_load_stats():
    even = torch.full((8,), 1 / 8)
    two = torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0, 0])
    s_even, s_two = T.load_stats(even), T.load_stats(two)
    assert float(s_even["max_share"]) == 0.125 and float(s_even["cv"]) < 1e-6 and int(s_even["idle"]) == 0
    assert float(s_two["max_share"]) == 0.5 and int(s_two["idle"]) == 6
    assert math.isclose(float(s_two["cv"]), math.sqrt(8 / 2 - 1), rel_tol=1e-6)   # the top-2 maximum
    with pytest.raises(ValueError, match="load"):
        T.load_stats([0.5, 0.5])


def test_bad_input():
    with pytest.raises(ValueError, match="aux_weight"):
        T.train(aux_weight=-0.1, steps=1)
    with pytest.raises(ValueError, match="z_weight"):
        T.train(z_weight=float("nan"), steps=1)
    with pytest.raises(ValueError, match="seq_len"):
        T.train(steps=1, seq_len=300)
    with pytest.raises(ValueError, match="steps"):
        T.train(steps=0)
    with pytest.raises(ValueError, match="num_heads"):
        T.TinyMoEConfig(hidden=30, num_heads=4)
    with pytest.raises(ValueError, match="k must be"):
        T.TinyMoEConfig(num_experts=2, k=3)
    with pytest.raises(ValueError, match="text"):
        byte_tokens("")
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        T.TinyMoELM(SMALL)(torch.zeros(5, dtype=torch.int64))
