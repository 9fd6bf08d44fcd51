"""llmu.scale.mfu: the definition, the measured training run, the published table."""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.models import LlamaConfig, byte_llama_config, make_trainable
from llmu.scale import mfu as M
from llmu.scale.flops import train_step_flops


def test_mfu_from_steps_uses_the_median_after_warmup():
    # warm-up 10 s is dropped; the median of (1, 1, 5) is 1 s: 1e9 FLOPs a step at a peak of 2e9
    assert M.mfu_from_steps([10.0, 1.0, 5.0, 1.0], 1e9, 2e9) == pytest.approx(0.5)
    assert M.mfu_from_steps([2.0, 2.0], 1e9, 1e9, warmup=0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="warmup"):
        M.mfu_from_steps([1.0], 1e9, 1e9)
    with pytest.raises(ValueError, match="positive"):
        M.mfu_from_steps([1.0, 0.0], 1e9, 1e9)
    with pytest.raises(ValueError, match="peak"):
        M.mfu(1e9, 0)


def test_published_table():
    table = {(r.name, r.hardware): r for r in M.PUBLISHED_MFU}
    assert table[("PaLM", "6144 TPU v4")].mfu == 0.462 and table[("PaLM", "6144 TPU v4")].hfu == 0.578
    llama = [r.mfu for r in M.PUBLISHED_MFU if r.name == "Llama 3 405B"]
    assert min(llama) == 0.38 and max(llama) == 0.43
    assert all(0 < r.mfu < 1 and r.source for r in M.PUBLISHED_MFU)


def test_byte_config_and_trainable_model():
    config = byte_llama_config(128, 2)
    assert (config.vocab_size, config.num_attention_heads, config.intermediate_size) == (256, 2, 384)
    model = make_trainable(config)
    assert model.training and all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match="multiple"):
        byte_llama_config(100, 2)
    with pytest.raises(TypeError, match="LlamaConfig"):
        make_trainable({"hidden": 128})


def test_train_run_learns_and_counts():
    torch.manual_seed(0)
    config = byte_llama_config(64, 1, max_len=64)
    run = M.train_run(config, batch=4, seq_len=32, steps=12, lr=1e-2)
    assert len(run.step_seconds) == len(run.losses) == 12
    assert run.flops_per_step == train_step_flops(config, 4, 32)
    assert run.tokens_per_step == 128 and run.achieved_flops > 0
    # it trains: from about ln(256) = 5.5 nats per byte at the start, clearly down after 12 steps
    assert run.losses[0] == pytest.approx(5.55, abs=0.1) and run.losses[-1] < run.losses[0] - 1.0
    assert run.mfu(run.achieved_flops * 4) == pytest.approx(0.25)
    again = M.train_run(config, batch=4, seq_len=32, steps=12, lr=1e-2)
    assert again.losses == run.losses   # seeded: the same run twice
    with pytest.raises(ValueError, match="vocab_size"):
        M.train_run(LlamaConfig(vocab_size=100), steps=2)
    with pytest.raises(ValueError, match="seq_len"):
        M.train_run(config, seq_len=65, steps=2)
    with pytest.raises(ValueError, match="warmup"):
        M.train_run(config, steps=2, warmup=2)
