"""The decode benchmark entry: registered, llmu and transformers in turn with a paired ratio, the same ids.

The fast tests run the entry on a tiny model (``load_model`` replaced); timings are not asserted
(other processes share the machine): the order of the calls, the rows' fields and the comparison
of the ids are."""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench.cli import ratio_note
from llmu.bench.registry import load_all
from llmu.models import LlamaConfig, LlamaModel, bench as models_bench, loading, tiny_llama
from llmu.models.generate import generate_ids


def test_entry_is_registered():
    entry = load_all()["decode_tokens_per_s"]
    assert entry.run is not None and entry.cpu_sizes == [{"prompt": 128, "new": 64, "repeats": 5}]
    assert all(s["new"] >= 64 and s["repeats"] >= 3 for s in entry.cpu_sizes + entry.gpu_sizes)


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


def _tiny():
    # eos 13: a token the greedy generation below produces early on, which must not stop it
    return tiny_llama(0, vocab_size=300, eos_token_id=13)


def test_transformers_makes_exactly_n_tokens_and_llmu_s_ids():
    pytest.importorskip("transformers")
    model = _tiny()
    prompt = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    want = list(generate_ids(model, prompt[0].tolist(), 20))
    assert 13 in want[:-1], "the end token comes up in the greedy generation"
    got = models_bench.run_transformers(models_bench.benchmark_copy(model), prompt, 20)
    assert got["ids"] == want and got["prefill_s"] > 0 and got["decode_s"] > 0
    assert models_bench.run_llmu(model, prompt, 20)["ids"] == want
    with pytest.raises(ValueError, match="eos_token_id"):  # a copy that would stop at the end token
        models_bench.run_transformers(models_bench.to_transformers(model), prompt, 20)


def test_llmu_and_transformers_are_called_in_turn():
    pytest.importorskip("transformers")
    p = models_bench.compare_decode(_tiny(), prompt_len=5, new_tokens=4, repeats=3)
    assert p.order == ["llmu", "llmu (modules)", "transformers"] * 3 and p.base == "transformers"
    assert p.mismatches == {}
    assert set(p.samples["llmu"]) == {"decode_tokens_per_s", "prefill_tokens_per_s"}
    assert p.outputs["llmu"] == p.outputs["llmu (modules)"] == p.outputs["transformers"]
    with pytest.raises(ValueError, match="providers"):
        models_bench.compare_decode(_tiny(), 5, 4, providers=("vllm",))


def test_entry_rows_on_a_tiny_model(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(loading, "load_model", lambda dtype, device: _tiny().to(dtype))
    rows = models_bench._run({"prompt": 5, "new": 4, "repeats": 2}, "cpu")
    assert [r["label"] for r in rows] == ["llmu prefill", "llmu decode", "llmu (modules) prefill",
                                          "llmu (modules) decode", "transformers prefill", "transformers decode"]
    for r in rows:
        assert r.get("status", "ok") == "ok" and r["rounds"] == 2 and r["n_samples"] == 2
        assert r["ms"] == pytest.approx(1e3 / r["tokens_per_s"]) and r["ratio_to"] == "transformers"
        assert "load_avg_start" in r and "load_avg_end" in r
    llmu_decode, hf_decode = rows[1], rows[5]
    # what DecodeStep buys, paired by round, on llmu's decode row only (and in the printed note)
    assert llmu_decode["over_modules_min"] <= llmu_decode["over_modules"] <= llmu_decode["over_modules_max"]
    assert all("over_modules" not in r for r in rows if r is not llmu_decode)
    assert "over the module path" in ratio_note(llmu_decode)
    assert llmu_decode["ratio_min"] <= llmu_decode["ratio"] <= llmu_decode["ratio_max"]
    assert llmu_decode["speedup"] == llmu_decode["ratio"] and isinstance(llmu_decode["ratio_overlaps_1"], bool)
    assert hf_decode["ratio"] is None and hf_decode["speedup"] == 1.0
    # the memory roof beside each decode row: every weight read once per token
    model = _tiny()
    for r in (llmu_decode, hf_decode):
        assert r["weight_bytes_per_token"] == model.num_parameters() * 4 and r["bandwidth_gbs"] > 0
        assert r["roof_tokens_per_s"] == pytest.approx(r["bandwidth_gbs"] * 1e9 / r["weight_bytes_per_token"])
        assert r["roof_fraction"] == pytest.approx(r["tokens_per_s"] / r["roof_tokens_per_s"])
    assert not any("roof_fraction" in r for r in rows[0::2])    # prefill is not bound by it
    assert "of the memory roof (" in ratio_note(llmu_decode)


def test_entry_fails_when_the_ids_differ(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(loading, "load_model", lambda dtype, device: _tiny().to(dtype))
    real = models_bench.run_transformers

    def other_ids(hf, prompt, n):
        r = real(hf, prompt, n)
        return dict(r, ids=r["ids"][:-1] + [(r["ids"][-1] + 1) % 300])  # the last token changed

    monkeypatch.setattr(models_bench, "run_transformers", other_ids)
    rows = models_bench._run({"prompt": 5, "new": 4, "repeats": 2}, "cpu")
    by = {r["label"]: r for r in rows}
    for label in ("llmu prefill", "llmu decode", "llmu (modules) prefill", "llmu (modules) decode"):
        assert by[label]["status"] == "error"
        assert "output differs from transformers's in round 1: token 3" in by[label]["reason"]
    assert "status" not in by["transformers decode"]
