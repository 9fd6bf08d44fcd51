"""Module 11's benchmark entries (``llmu.spec.bench``): registered, sane rows, identical output enforced.

- ``spec_decode``: plain and each draft run in turn, round after round (on a tiny model), and the
  entry's rows carry the paired ratio over plain; its CPU size runs through the runner on SmolLM2
  (slow: SmolLM2, at fewer tokens and rounds): one row per provider, plain's speed-up 1, every speed-up positive,
  acceptance in [0, 1], tokens/step in [1, gamma + 1]; a loop that changed the greedy output makes
  its rows errors (plain's stays) and ``measure_spec`` raise ``OutputMismatch``. Timings are not
  asserted (other processes share the machine).
- ``spec_accept_reject``: its formulas by hand, the Triton kernel and the torch reference agree
  on its inputs, its CPU sizes run through the runner (the Triton rows skipped).
"""

from __future__ import annotations

import pytest
import torch

import llmu.models
import llmu.spec.prompts
from llmu.bench import runner
from llmu.bench.registry import REGISTRY, TOPICS, load_all
from llmu.kvcache.reference import decode_cached
from llmu.models import tiny_llama
from llmu.spec import bench
from llmu.spec.decode import SpecOutput, speculative_generate
from llmu.spec.drafts import EarlyExitDraft, NGramDraft, QuantizedDraft
from llmu.spec.quantized_step import quantized_unavailable

pytestmark = pytest.mark.kernels

PROMPT = [5, 9, 3, 7, 5, 9, 3]


def test_entries_are_registered():
    assert TOPICS.index("quant") < TOPICS.index("spec") < TOPICS.index("engine")
    load_all()
    decode, step = REGISTRY["spec_decode"], REGISTRY["spec_accept_reject"]
    assert decode is bench.SPEC_DECODE and step is bench.SPEC_ACCEPT_REJECT
    for entry in (decode, step):
        assert entry.module == "11_speculative_decoding" and entry.cpu_sizes and entry.gpu_sizes
    assert decode.run is not None and decode.x_axis == "prompt"
    assert {s["prompt"] for s in decode.gpu_sizes} == {"edit", "summarise", "story"}
    assert max(s["new"] for s in decode.gpu_sizes) > max(s["new"] for s in decode.cpu_sizes)
    assert all(s["new"] >= 64 and s["repeats"] >= 3 for s in decode.cpu_sizes + decode.gpu_sizes)
    assert [p.kind for p in step.providers.values()] == ["triton", "torch"]
    assert {s["V"] for s in step.gpu_sizes} == {49152} and max(s["V"] for s in step.cpu_sizes) < 49152


def test_make_draft_and_its_key():
    model = tiny_llama(0)
    ngram = bench.make_draft(model, "ngram")
    assert isinstance(ngram, NGramDraft) and (ngram.max_ngram, ngram.min_ngram) == (3, 1)
    exit1 = bench.make_draft(model, "exit1")
    assert isinstance(exit1, EarlyExitDraft) and exit1.num_layers == 1
    assert [bench.draft_key(d) for d in (ngram, exit1)] == ["ngram", "exit1"]
    for bad in ("exit", "early4", 4, "exit3"):  # exit3: the tiny model has 2 blocks
        with pytest.raises(ValueError):
            bench.make_draft(model, bad)
    if quantized_unavailable() is None:
        mid = tiny_llama(0, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16)
        int4 = bench.make_draft(mid, "int4")
        assert isinstance(int4, QuantizedDraft) and int4.group_size == 32 and bench.draft_key(int4) == "int4"
        with pytest.raises(ValueError, match="must divide"):
            bench.make_draft(model, "int4")  # the tiny model's 48 inputs are not groups of 32


def test_check_identical():
    bench.check_identical([1, 2, 3], [1, 2, 3], "same")
    with pytest.raises(bench.OutputMismatch, match=r"at token 1 .*5 instead of 2"):
        bench.check_identical([1, 2, 3], [1, 5, 3], "one token")
    with pytest.raises(bench.OutputMismatch, match=r"at token 2 \(2 tokens against 3; end instead of 3\)"):
        bench.check_identical([1, 2, 3], [1, 2], "shorter")


def test_measure_spec_on_a_tiny_model():
    model = tiny_llama(0)
    runs = {"n-gram": (NGramDraft(), 3), "exit 1": (EarlyExitDraft(model, 1), 2),
            "exit 2": (EarlyExitDraft(model, 2), 2)}
    m = bench.measure_spec(model, PROMPT, runs, 20, repeats=2)
    assert list(m) == ["plain", "n-gram", "exit 1", "exit 2"]
    assert m["plain"]["tokens"] == len(decode_cached(model, PROMPT, 20).tokens) == 20
    assert m["plain"]["gamma"] == 0 and m["plain"]["acceptance"] is None and m["plain"]["steps"] == 20
    for name, r in m.items():
        assert r["tokens"] == 20 and r["seconds"] > 0 and 0 <= r["draft_s"] <= r["seconds"]
        assert 1 <= r["tokens_per_step"] <= r["gamma"] + 1
        if name != "plain":
            assert 0 <= r["acceptance"] <= 1
    assert m["exit 2"]["acceptance"] == 1.0  # the draft is the whole target
    with pytest.raises(ValueError, match="repeats"):
        bench.measure_spec(model, PROMPT, runs, 5, repeats=0)
    with pytest.raises(ValueError, match="plain"):
        bench.measure_spec(model, PROMPT, {"plain": (NGramDraft(), 2)}, 5)


def _corrupting(monkeypatch):
    """Make the speculative loop (gamma > 0) change its last token: a broken decoder."""
    def broken(*args, **kw):
        out = speculative_generate(*args, **kw)
        if kw.get("gamma", 4) > 0:
            out = SpecOutput(out.tokens[:-1] + [out.tokens[-1] + 1], out.stats)
        return out

    monkeypatch.setattr(bench, "speculative_generate", broken)


def test_a_changed_output_raises(monkeypatch):
    _corrupting(monkeypatch)
    with pytest.raises(bench.OutputMismatch, match="n-gram"):
        bench.measure_spec(tiny_llama(0), PROMPT, {"n-gram": (NGramDraft(), 3)}, 10, repeats=1)


def test_plain_and_drafts_run_in_turn():
    model = tiny_llama(0)
    p = bench.compare_spec(model, PROMPT, {"n-gram": (NGramDraft(), 3), "exit 1": (EarlyExitDraft(model, 1), 2)},
                           12, repeats=2)
    assert p.order == ["plain", "n-gram", "exit 1"] * 2 and p.base == "plain" and p.reference == "plain"
    assert p.mismatches == {} and p.figure == "decode_tokens_per_s"
    assert p.outputs["n-gram"][1] == p.outputs["plain"][1] == decode_cached(model, PROMPT, 12).tokens
    assert p.ratio("n-gram")["n"] == 2 and p.info["exit 1"][0]["gamma"] == 2
    with pytest.raises(ValueError, match="max_new_tokens"):
        bench.compare_spec(model, PROMPT, {}, 1)


SIZE = {"prompt": "edit", "new": 12, "gamma": 3, "exit": 1, "exit_gamma": 2, "repeats": 2}


def _tiny_entry(monkeypatch):
    """The entry's _run on a tiny model and PROMPT, with no end token."""
    monkeypatch.setattr(llmu.models, "load_model", lambda dtype, device: tiny_llama(0).to(dtype))
    monkeypatch.setattr(llmu.models, "load_tokenizer", lambda: None)
    monkeypatch.setattr(llmu.spec.prompts, "prompt_ids", lambda tokenizer, name: list(PROMPT))
    monkeypatch.setattr(llmu.spec.prompts, "end_token", lambda tokenizer: None)


def test_entry_rows_on_a_tiny_model(monkeypatch):
    _tiny_entry(monkeypatch)
    rows = bench._run(SIZE, "cpu")
    assert [r["provider"] for r in rows] == ["plain", "n-gram", "early exit 1"]
    for r in rows:
        assert r.get("status", "ok") == "ok" and r["rounds"] == 2 and r["ratio_to"] == "plain"
        assert r["ms"] == pytest.approx(1e3 / r["tokens_per_s"]) and r["tokens"] == 12
        assert 0 <= r["draft_share"] < 1 and "load_avg_start" in r
    plain, ngram, _ = rows
    assert plain["ratio"] is None and plain["speedup"] == 1.0
    assert ngram["speedup"] == ngram["ratio"] and ngram["ratio_min"] <= ngram["ratio"] <= ngram["ratio_max"]


def test_entry_rows_fail_on_a_changed_output(monkeypatch):
    _tiny_entry(monkeypatch)
    _corrupting(monkeypatch)
    plain, *drafts = bench._run(SIZE, "cpu")
    assert "status" not in plain
    for row in drafts:
        assert row["status"] == "error" and "differs from plain greedy decoding at token 11" in row["reason"]


@pytest.mark.slow  # loads SmolLM2
def test_spec_decode_cpu_size_on_smollm2(smollm2):
    # the CPU size's prompt, drafts and gammas, with fewer tokens and rounds: the suite checks the
    # rows, `llmu bench spec_decode --sizes cpu` measures (about a minute)
    size = dict(bench.SPEC_DECODE.cpu_sizes[0], new=24, repeats=2)
    rows = runner.run(["spec_decode"], device="cpu", sizes=[size], entries=[bench.SPEC_DECODE])["rows"]
    quantized = ["4-bit draft"] if quantized_unavailable() is None else []
    assert [r["provider"] for r in rows] == ["plain", "n-gram", f"early exit {size['exit']}"] + quantized
    by = {r["provider"]: r for r in rows}
    for r in rows:
        assert r["status"] == "ok", r["reason"]
        assert r["kind"] == "torch" and r["dtype"] == "float32" and r["x"] == size["prompt"]
        assert r["tokens_per_s"] > 0 and r["ms"] == pytest.approx(1e3 / r["tokens_per_s"])
        assert r["rounds"] == size["repeats"] and r["ratio_to"] == "plain" and r["speedup"] > 0
        assert r["tokens"] == by["plain"]["tokens"] == size["new"] and 1 <= r["tokens_per_step"] <= r["gamma"] + 1
        assert r["steps"] * r["tokens_per_step"] == pytest.approx(r["tokens"])
        assert 0 <= r["draft_share"] < 1
    assert by["plain"]["speedup"] == 1 and by["plain"]["acceptance"] is None and by["plain"]["gamma"] == 0
    ngram, early = by["n-gram"], by[f"early exit {size['exit']}"]
    for r in (ngram, early):
        assert r["speedup"] == r["ratio"] and r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
    assert ngram["gamma"] == size["gamma"] and early["gamma"] == size["exit_gamma"]
    assert 0 <= early["acceptance"] <= 1 and early["draft_share"] > 0
    assert 0.3 < ngram["acceptance"] <= 1 and ngram["tokens_per_step"] > 1.5  # the edit prompt copies itself
    if quantized:  # the model at 4 bits guesses the float32 model's greedy tokens nearly always
        int4 = by["4-bit draft"]
        assert int4["gamma"] == size["int4_gamma"] and int4["acceptance"] > 0.8 and int4["draft_share"] > 0


# ----------------------------------------------------------------------------------------------
# spec_accept_reject
# ----------------------------------------------------------------------------------------------


def test_accept_reject_formulas_by_hand():
    size = {"B": 2, "gamma": 3, "V": 10}
    assert bench.accept_reject_flops(size) == 2 * (2 * 3 + 6 * 10)
    per_seq = 2 * 3 * 2 + 2 * 10 * 2 + 3 * 8 + 3 * 4 + 4 + 16  # bf16: scalars, two rows, ids, u, r, outputs
    assert bench.accept_reject_bytes(size, 2) == 2 * per_seq
    # the kernel's napkin math: B = 32, V = 49,152, bf16: about 6.3 MB of rows
    big = bench.accept_reject_bytes({"B": 32, "gamma": 4, "V": 49152}, 2)
    assert 6.2e6 < big < 6.4e6


def test_accept_reject_providers_agree(kdev):
    size = {"B": 6, "gamma": 4, "V": 300}
    p, q, draft, u, r = bench.accept_reject_setup(size, kdev, torch.float32)
    assert p.shape == (6, 5, 300) and q.shape == (6, 4, 300) and draft.shape == (6, 4)
    torch.testing.assert_close(p.sum(-1), torch.ones(6, 5, device=kdev))
    providers = bench.SPEC_ACCEPT_REJECT.providers
    acc_t, tok_t = providers["llmu triton"].fn(p, q, draft, u, r)
    acc_r, tok_r = providers["llmu torch"].fn(p, q, draft, u, r)
    assert torch.equal(acc_t.cpu(), acc_r.cpu()) and torch.equal(tok_t.cpu(), tok_r.cpu())
    assert 0 < int(acc_r.sum()) < 6 * 4  # a draft that agrees in part: some accepted, some not


def test_accept_reject_cpu_sizes_run_through_the_runner(check_cpu_sizes_run):
    check_cpu_sizes_run([bench.SPEC_ACCEPT_REJECT])
