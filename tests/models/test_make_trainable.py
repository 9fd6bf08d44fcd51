"""llmu.models.make_trainable: a LlamaModel with fresh weights to train from scratch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import llmu  # noqa: F401
from llmu.models import make_trainable, tiny_llama


def test_fresh_weights_gains_biases_and_gradients():
    config = dataclasses.replace(tiny_llama().config, attention_bias=True)
    model = make_trainable(config, seed=3, std=0.05)
    assert model.training and all(p.requires_grad for p in model.parameters())
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif p.ndim == 1:
            assert torch.equal(p, torch.ones_like(p)), f"{name}: a norm gain starts at 1"
        else:
            assert abs(p.std().item() - 0.05) < 0.01, f"{name}: N(0, std^2)"
    assert any(n.endswith("bias") for n, _ in model.named_parameters()), "the config has biases to check"


def test_seeded_and_trains():
    config = tiny_llama().config
    a, b, c = make_trainable(config, seed=1), make_trainable(config, seed=1), make_trainable(config, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    a(ids).logits.sum().backward()
    assert all(p.grad is not None for p in a.parameters())


def test_bad_arguments():
    with pytest.raises(TypeError, match="LlamaConfig"):
        make_trainable({"hidden_size": 64})
    with pytest.raises(ValueError, match="std"):
        make_trainable(tiny_llama().config, std=0)
