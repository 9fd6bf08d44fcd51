"""The perplexity table of module 07: the script that computes it (``python -m llmu.gqa.precompute``)
and the copy shipped in ``llmu/data/gqa_perplexity.json`` that the notebook reads.

The shipped table is checked for what the notebook relies on (every variant of the script, the
whole essays, the windows of the strided evaluation, each perplexity equal to what its windows'
log-likelihoods give), and a sample of it is recomputed live: the script scores the first window
(512 tokens) of the model as shipped and of one conversion, which must give the log-likelihoods
the table holds for that window.
"""

from __future__ import annotations

import json
import math

import pytest

from llmu.data import json as shipped_json, text
from llmu.gqa import precompute
from llmu.models import load_tokenizer  # the tokenizer only (GGUF metadata), not the weights
from llmu.models.perplexity import windows

# The live sample: the model as shipped, and a conversion (pooling half the layers) whose window
# log-likelihood is far from every other variant's, so that a wrong conversion cannot pass.
LIVE_VARIANTS = ["gqa3", "mqa_mean_second_half"]


def test_shipped_table():
    record = shipped_json("gqa_perplexity")
    assert record["made_by"] == "python -m llmu.gqa.precompute"
    assert (record["text"], record["window"], record["stride"], record["dtype"]) == (
        "essays", precompute.WINDOW, precompute.STRIDE, "float32")
    assert record["tokens"] == len(load_tokenizer().encode(text("essays"), add_special_tokens=False))
    assert record["windows"] == [list(w) for w in windows(record["tokens"], record["window"], record["stride"])]
    assert list(record["variants"]) == list(precompute.VARIANTS)
    for name, row in record["variants"].items():
        assert row["description"] == precompute.VARIANTS[name][0]
        assert len(row["window_nll"]) == len(record["windows"])
        # token 0 is never scored: tokens - 1 predictions in all
        assert row["perplexity"] == pytest.approx(math.exp(sum(row["window_nll"]) / (record["tokens"] - 1)), rel=1e-9)
    ppl = {name: row["perplexity"] for name, row in record["variants"].items()}
    # what the notebook's prose says: any conversion costs perplexity; mean-pooling beats keeping
    # one head; converting half the layers costs less than converting all
    assert ppl["gqa3"] < ppl["mqa_mean_second_half"] < ppl["mqa_mean"] < ppl["mqa_first"]
    assert ppl["mqa_mean_second_half"] < ppl["mqa_first_second_half"]


@pytest.mark.slow  # loads SmolLM2
def test_a_sample_of_the_table_recomputes_live(tmp_path, smollm2):
    shipped = shipped_json("gqa_perplexity")
    first = shipped["windows"][0]
    assert first == [0, shipped["window"], 1]     # the first window: tokens 0 .. 511, scoring 1 .. 511
    out = tmp_path / "first_window.json"
    precompute.main(["--tokens", str(first[1]), "--variants", *LIVE_VARIANTS, "--out", str(out)])
    live = json.loads(out.read_text())
    assert live["windows"] == [first] and list(live["variants"]) == LIVE_VARIANTS
    for name in LIVE_VARIANTS:
        got, want = live["variants"][name]["window_nll"][0], shipped["variants"][name]["window_nll"][0]
        # A window's summed log-likelihood (about 1,800 nats for the model as shipped, 511 tokens)
        # moves by about 1e-6 of itself when float32 sums run in another order: here the window is
        # a batch of one, in the table a batch of four, and the thread count may differ. 1e-4 is a
        # hundred times that, and far below what another model, text, tokenizer or conversion gives
        # (the first windows of the two closest variants differ by 5 %).
        assert got == pytest.approx(want, rel=1e-4), name
