"""The word helpers of the embeddings notebook: a stand-in tokenizer, and (slow) SmolLM2's own."""

from __future__ import annotations

import pytest
import torch

from llmu.embeddings.words import WORD_GROUPS, neighbour_table, pca_figure, token_id, token_ids


class _ToyTokenizer:
    """Whole words are one token each; anything with a dash splits in two."""

    def __init__(self, words):
        self.vocab = {w: i for i, w in enumerate(words)}
        self.inverse = {i: w for w, i in self.vocab.items()}

    def encode(self, text, add_special_tokens=False):
        return [self.vocab.get(p, 0) for p in text.split("-")]

    def token_to_str(self, i):
        return self.inverse[i]


def test_token_ids_keep_single_tokens_only():
    tok = _ToyTokenizer(["<unk>", " a", " b", " c"])
    assert token_id(tok, " b") == 2
    with pytest.raises(ValueError, match="not a single token"):
        token_id(tok, " a- b")
    assert token_ids(tok, [" a", " a- b", " c"]) == ([" a", " c"], [1, 3])


def test_pca_figure_and_neighbour_table_on_a_toy_table():
    words = ["<unk>"] + [f" w{i}" for i in range(8)]
    tok = _ToyTokenizer(words)
    table = torch.randn(len(words), 16)
    fig = pca_figure(table, tok, {"g1": words[1:5], "g2": words[5:]})
    assert {t.name for t in fig.data} == {"g1", "g2"}
    assert sum(len(t.x) for t in fig.data) == 8
    with pytest.raises(ValueError, match="at least 3"):
        pca_figure(table, tok, {"g": words[1:3]})
    lines = neighbour_table([" w0"], torch.tensor([[0.5, 0.25]]), torch.tensor([[2, 3]]), tok)
    assert lines == [" " * 9 + "' w0' -> ' w1' 0.50, ' w2' 0.25"]  # the query right-aligned in 14 characters


@pytest.mark.slow
def test_word_groups_are_single_smollm2_tokens():
    models = pytest.importorskip("llmu.models")
    try:
        tok = models.load_tokenizer()
    except Exception as exc:  # noqa: BLE001 - no model file on this machine
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc}")
    for name, words in WORD_GROUPS.items():
        kept, _ = token_ids(tok, words)
        assert kept == words, f"{name}: {set(words) - set(kept)} split into several tokens"
