"""LoRA adapters: start equal to the base model, train only A and B, merge/unmerge, counts."""

from __future__ import annotations

import math

import pytest
import torch

from llmu.models import Linear, tiny_llama
from llmu.training.lora import (
    LoRALinear,
    add_lora,
    lora_disabled,
    lora_layers,
    lora_parameters,
    lora_state_dict,
    merge_lora,
    parameter_counts,
    unload_lora,
    unmerge_lora,
)

IDS = torch.tensor([[5, 17, 3, 42, 8, 60, 1, 9], [2, 2, 77, 30, 11, 4, 19, 90]])


def _linear(in_f=12, out_f=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Linear(in_f, out_f, weight=torch.randn(out_f, in_f, generator=g))


def _train_adapters(model, steps=3):
    """A few SGD steps on the adapters, so that B (and the update B A) is no longer zero."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    for _ in range(steps):
        logits = model(IDS).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def test_layer_formula_and_zero_start():
    base = _linear()
    layer = LoRALinear(base, r=3, alpha=6, generator=torch.Generator().manual_seed(1))
    x = torch.randn(4, 12)
    # B = 0: the wrapped layer starts exactly equal to the base layer
    torch.testing.assert_close(layer(x), x @ base.weight.T, rtol=0, atol=0)
    with torch.no_grad():
        layer.lora_B.normal_()
    expected = x @ base.weight.T + (6 / 3) * x @ layer.lora_A.T @ layer.lora_B.T
    torch.testing.assert_close(layer(x), expected)
    torch.testing.assert_close(layer.delta_weight(), 2.0 * layer.lora_B @ layer.lora_A)


def test_kaiming_init_bound_and_gaussian():
    layer = LoRALinear(_linear(in_f=64, out_f=32), r=8, alpha=16)
    bound = 1 / math.sqrt(64)
    assert layer.lora_A.abs().max() <= bound
    assert layer.lora_A.abs().max() > 0.8 * bound          # uniform over the whole interval
    assert torch.count_nonzero(layer.lora_B) == 0
    gauss = LoRALinear(_linear(in_f=64, out_f=32), r=8, alpha=16, init="gaussian",
                       generator=torch.Generator().manual_seed(0))
    # std 1/r = 0.125 over 512 draws: the sample std is within 15 % of it
    assert gauss.lora_A.std().item() == pytest.approx(1 / 8, rel=0.15)


def test_base_frozen_adapters_trainable():
    layer = LoRALinear(_linear(), r=2, alpha=4)
    assert not layer.base.weight.requires_grad
    assert layer.lora_A.requires_grad and layer.lora_B.requires_grad
    layer(torch.randn(3, 12)).sum().backward()
    assert layer.base.weight.grad is None
    # B = 0 at the start: A gets no gradient yet, B does (dL/dB = scaling * dy^T (x A^T))
    assert torch.count_nonzero(layer.lora_A.grad) == 0
    assert torch.count_nonzero(layer.lora_B.grad) > 0


def test_add_lora_wraps_targets_and_keeps_outputs():
    model = tiny_llama(seed=0)
    before = model(IDS).logits
    add_lora(model, targets=("q_proj", "v_proj"), r=4, alpha=8)
    layers = lora_layers(model)
    assert sorted(layers) == sorted(f"layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj"))
    torch.testing.assert_close(model(IDS).logits, before, rtol=0, atol=0)


def test_parameter_counts_match_formula():
    model = tiny_llama(seed=0)
    total_before = parameter_counts(model).total
    assert parameter_counts(model).trainable == 0          # tiny_llama is frozen
    add_lora(model, targets=("q_proj", "v_proj", "down_proj"), r=4, alpha=8)
    counts = parameter_counts(model)
    # config: hidden 48, 6 heads x head_dim 8 = 48 query outputs, 2 KV heads x 8 = 16, MLP 64 -> 48
    expected = 2 * (4 * (48 + 48) + 4 * (48 + 16) + 4 * (64 + 48))
    assert counts.trainable == expected
    layers = lora_layers(model).values()
    assert counts.trainable == sum(lora_parameters(m.in_features, m.out_features, 4) for m in layers)
    assert counts.total == total_before + expected
    assert counts.fraction == pytest.approx(expected / counts.total)
    assert "trainable of" in str(counts)
    assert lora_parameters(576, 576, 8) == 9216


def test_parameter_counts_tied_embeddings_counted_once():
    model = tiny_llama(seed=0, tie_word_embeddings=True)
    assert parameter_counts(model).total == model.num_parameters()


def test_training_changes_only_adapters():
    model = tiny_llama(seed=0)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    add_lora(model, targets=("q_proj", "v_proj"), r=4, alpha=8)
    _train_adapters(model.train())
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            continue
        original = name.replace(".base.", ".")
        torch.testing.assert_close(tensor, base_state[original], rtol=0, atol=0)
    assert all(torch.count_nonzero(m.lora_B) > 0 for m in lora_layers(model).values())
    assert set(lora_state_dict(model)) == {f"{n}.lora_{ab}" for n in lora_layers(model) for ab in "AB"}


def test_merge_equals_adapted_and_unmerge_restores_base():
    model = tiny_llama(seed=0)
    base_weights = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, Linear)}
    base_logits = model(IDS).logits
    add_lora(model, targets=("q_proj", "v_proj", "o_proj"), r=4, alpha=8)
    _train_adapters(model.train())
    model.eval()
    with torch.no_grad():
        adapted = model(IDS).logits
        assert not torch.allclose(adapted, base_logits, atol=1e-3)      # the adapters do something
        merge_lora(model)
        assert all(m.merged for m in lora_layers(model).values())
        # W + (alpha/r) B A in one matmul vs x W^T + (alpha/r) x A^T B^T: the same sum, rounded in
        # another order; float32 with logits of size ~1 agrees to ~1e-6
        torch.testing.assert_close(model(IDS).logits, adapted, rtol=1e-5, atol=1e-5)
        unmerge_lora(model)
    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            w, w0 = layer.base.weight, base_weights[name]
            # (W + D) - D is W up to the rounding of W + D: half an ulp of |W| + |D| per entry
            ulp = torch.finfo(torch.float32).eps * (w0.abs() + layer.delta_weight().abs())
            assert ((w - w0).abs() <= ulp).all(), name
        torch.testing.assert_close(model(IDS).logits, adapted, rtol=1e-5, atol=1e-5)


def test_unload_keeps_the_adapted_model_and_allows_new_adapters():
    model = add_lora(tiny_llama(seed=0), targets=("q_proj", "v_proj"), r=4, alpha=8)
    _train_adapters(model.train())
    model.eval()
    with torch.no_grad():
        adapted = model(IDS).logits
        unload_lora(model)
        assert not lora_layers(model)
        assert all(type(m) is Linear for n, m in model.named_modules() if n.endswith(("q_proj", "v_proj")))
        torch.testing.assert_close(model(IDS).logits, adapted, rtol=1e-5, atol=1e-5)  # as for merge
    add_lora(model, targets=("q_proj",), r=2, alpha=4)          # a second round of adapters
    with torch.no_grad(), lora_disabled(model):
        torch.testing.assert_close(model(IDS).logits, adapted, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no LoRA adapters to unload"):
        unload_lora(tiny_llama(seed=0))


def test_lora_disabled_gives_base_model():
    model = tiny_llama(seed=0)
    base_logits = model(IDS).logits
    add_lora(model, targets=("q_proj", "v_proj"), r=4, alpha=8)
    _train_adapters(model.train())
    with torch.no_grad():
        adapted = model(IDS).logits
        with lora_disabled(model):
            torch.testing.assert_close(model(IDS).logits, base_logits, rtol=0, atol=0)
        torch.testing.assert_close(model(IDS).logits, adapted, rtol=0, atol=0)
    merge_lora(model)
    with pytest.raises(RuntimeError, match="unmerge"):
        with lora_disabled(model):
            pass


def test_bad_inputs():
    with pytest.raises(TypeError, match="r must be a positive int"):
        LoRALinear(_linear(), r=2.5)
    with pytest.raises(ValueError, match="r must be at most"):
        LoRALinear(_linear(in_f=12, out_f=10), r=11)
    with pytest.raises(ValueError, match="alpha must be positive"):
        LoRALinear(_linear(), r=2, alpha=0)
    with pytest.raises(ValueError, match="init must be"):
        LoRALinear(_linear(), r=2, init="zeros")
    with pytest.raises(TypeError, match="base must be a linear layer"):
        LoRALinear(torch.nn.ReLU())
    with pytest.raises(TypeError, match="adapters do not nest"):
        LoRALinear(LoRALinear(_linear(), r=2), r=2)
    model = tiny_llama(seed=0)
    with pytest.raises(ValueError, match=r"targets \['qproj'\] match no projection"):
        add_lora(model, targets=("qproj",))
    with pytest.raises(ValueError, match="non-empty"):
        add_lora(model, targets=())
    with pytest.raises(TypeError, match="LlamaModel"):
        add_lora(torch.nn.Linear(3, 3))
    add_lora(model, targets="q_proj", r=2)
    with pytest.raises(ValueError, match="already has LoRA"):
        add_lora(model)
    layer = next(iter(lora_layers(model).values()))
    with pytest.raises(RuntimeError, match="not merged"):
        layer.unmerge()
    layer.merge()
    with pytest.raises(RuntimeError, match="already merged"):
        layer.merge()
    with pytest.raises(ValueError, match="no LoRA adapters"):
        merge_lora(tiny_llama(seed=0))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        parameter_counts("model")
