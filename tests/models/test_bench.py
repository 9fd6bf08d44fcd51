"""The decode benchmark entry: registered, and its measurement runs."""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench.registry import load_all
from llmu.models import LlamaConfig, LlamaModel
from llmu.models import bench as models_bench


def test_entry_is_registered():
    entry = load_all()["decode_tokens_per_s"]
    assert entry.run is not None and entry.cpu_sizes == [{"prompt": 128, "new": 128}]


def test_to_transformers_computes_the_same_function():
    pytest.importorskip("transformers")
    model = LlamaModel(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    hf = models_bench.to_transformers(model)
    ids = torch.randint(0, 50, (1, 9), generator=g)
    with torch.no_grad():
        # float32, identical weights: rounding-level differences only
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_measure_small(smollm2):
    model, _ = smollm2
    result = models_bench.measure(model, prompt_len=8, new_tokens=3, repeats=1, providers=("llmu",))
    r = result["llmu"]
    assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
    with pytest.raises(ValueError, match="new_tokens must be >= 2"):
        models_bench.measure(model, new_tokens=1, providers=("llmu",))
