"""SmolLM2's own vocabulary and merges, loaded into llmu's ``BPETokenizer`` with SmolLM2's
pre-tokeniser, encode every text llmu ships exactly as llmu's GGUF tokenizer
(``llmu.models.load_tokenizer()``) and as a ``tokenizers`` Tokenizer built here from the file's
metadata (SmolLM2's ``tokenizer.json`` recipe: Digits then ByteLevel, the control tokens as special
added tokens); decoding gives the texts back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from llmu.models import load_tokenizer
from llmu.models.gguf_file import GGUFFile
from llmu.tokenization import BPETokenizer, smollm2_tokenizer, smollm2_vocab_merges
from llmu.tokenization.bench import shipped_strings, shipped_texts
from llmu.tokenization.pretokenize import pretokenize_gpt2

TEXTS = shipped_texts()
CHAT = ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 12 * 34? Say it in"
        " French, s'il vous plaît 🙂<|im_end|>\n<|im_start|>assistant\n<|endoftext|>")


@pytest.fixture(scope="module")
def ours():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def backend():
    with GGUFFile() as f:
        tokens, merges = f.get("tokenizer.ggml.tokens"), f.get("tokenizer.ggml.merges")
        types = f.get("tokenizer.ggml.token_type")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ")) for m in merges], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    return tok


def test_vocab_and_merges_as_bytes(ours):
    vocab, merges, specials = smollm2_vocab_merges()
    assert len(vocab) == 49152 and len(merges) == 48900
    assert specials[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and len(specials) == 17
    assert all(a + b in ours._id_of for a, b in merges)
    gguf = load_tokenizer()
    the = gguf.encode(" the")
    assert len(the) == 1 and vocab[the[0]] == b" the"


@pytest.mark.parametrize("name", list(TEXTS) + ["chat"])
def test_every_shipped_text_encodes_as_llmus_tokenizer_and_tokenizers(name, ours, backend):
    text = CHAT if name == "chat" else TEXTS[name]
    ids = ours.encode(text)
    assert ids == load_tokenizer().encode(text)
    assert ids == backend.encode(text, add_special_tokens=False).ids
    assert ours.decode(ids) == text == backend.decode(ids, skip_special_tokens=False)


def test_every_json_string_on_its_own(ours):
    """Each string of the .json files separately (a piece's start matters to pre-tokenisation)."""
    gguf = load_tokenizer()
    strings = shipped_strings()
    assert len(strings) > 100
    for s in strings:
        assert ours.encode(s) == gguf.encode(s), s[:80]


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cn", "Cs"), max_codepoint=0x2FFFF), max_size=40))
def test_random_text(ours, backend, text):
    try:
        ids = ours.encode(text)
    except ValueError as exc:  # a byte SmolLM2 has no token for (0x04, ...): tokenizers drops it
        assert "has no token in this vocabulary" in str(exc)
        return
    assert ids == backend.encode(text, add_special_tokens=False).ids
    assert ours.decode(ids) == text


def test_streaming_a_shipped_file(ours):
    text = TEXTS["luke_kjv.txt"]
    assert list(ours.encode_iterable(text.splitlines(keepends=True))) == ours.encode(text)


def test_the_pre_tokeniser_is_part_of_the_tokenizer(ours):
    """The same vocabulary and merges with GPT-2's pattern alone give other ids: before a digit,
    GPT-2's pattern cuts "\\n\\n" into "\\n", "\\n" (its ``\\s+(?!\\S)`` leaves the last
    white-space character to the digit, and then ``\\s+`` takes it alone), while SmolLM2 isolates the
    digit first and keeps "\\n\\n" whole."""
    vocab, merges, specials = smollm2_vocab_merges()
    gpt2_style = BPETokenizer(vocab, merges, specials, pretokenizer=pretokenize_gpt2)
    text = "Essays\n\n1. Salt"
    gguf = load_tokenizer()
    assert ours.encode(text) == gguf.encode(text)
    assert [gpt2_style.decode([i]) for i in gpt2_style.encode(text)][-5:-1] == ["\n", "\n", "1", "."]
    assert [ours.decode([i]) for i in ours.encode(text)][-4:-1] == ["\n\n", "1", "."]
