"""Pre-tokenisation: llmu's GPT-2 pattern (Python's ``re``, the Unicode classes spelled out) cuts
text exactly as the ``regex`` package's ``\\p{}`` pattern and as the ``tokenizers`` library's
ByteLevel pre-tokenizer do; SmolLM2's variant as ``tokenizers``' Digits + ByteLevel; special tokens
are cut out whole, the longest first."""

from __future__ import annotations

import sys
import unicodedata

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import pre_tokenizers

from llmu.tokenization import byte_alphabet
from llmu.tokenization.bench import shipped_texts
from llmu.tokenization.pretokenize import (
    GPT2_PATTERN,
    WHITE_SPACE,
    _unicode_classes,
    pretokenize_gpt2,
    pretokenize_smollm2,
    split_special_tokens,
)

TRICKY = [
    "", " ", "  ", "a  b", "a   \n\n  b", "Hello, world!", "I'm can't we'll they've DON'T 'S",
    "2024 x100 3.14159 ½ ² ١٢٣ Ⅻ 一二三", "héllo wörld 日本語 🤗 Ωμέγα Привет", "tab\there\r\nwin",
    "\u00a0nbsp\u2003em\u3000ideo", "\x1c\x1d\x1e\x1f control", "  trailing  ", "x\u0301 e\u0301", "!!! ?? ... --",
    "end of line \n", "\n\n\n", "a\x85b",
]

# Text drawn from the character kinds the pattern distinguishes, or any assigned character. (Code
# points this Python's Unicode database does not know (Cn) are left out: a library built on a newer
# Unicode version may already call them letters.)
TEXT = (st.text(alphabet=st.sampled_from(list("ab Z9'smtlvedré日½²٣ \n\t.,!?-\u00a0\u2003\x1cÉ🎉")), max_size=60)
        | st.text(alphabet=st.characters(blacklist_categories=("Cn", "Cs")), max_size=40))


def _regex_package_split(text):
    regex = pytest.importorskip("regex")
    return regex.findall(GPT2_PATTERN, text)


def _tokenizers_split(pre, text):
    """``tokenizers``' pieces, mapped back from its byte alphabet to text."""
    return [byte_alphabet.token_to_bytes(p).decode("utf-8") for p, _ in pre.pre_tokenize_str(text)]


BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
SMOLLM2 = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), BYTE_LEVEL])


def test_unicode_classes_are_the_general_categories():
    """The spelled-out classes hold exactly the code points of category L*, N* and White_Space."""
    import re

    letters, numbers, space = (re.compile(f"[{c}]") for c in _unicode_classes())
    for cp in range(0, sys.maxunicode + 1, 7):   # every 7th code point: all blocks, fast
        ch = chr(cp)
        cat = unicodedata.category(ch)[0]
        assert bool(letters.fullmatch(ch)) == (cat == "L"), hex(cp)
        assert bool(numbers.fullmatch(ch)) == (cat == "N"), hex(cp)
        assert bool(space.fullmatch(ch)) == (ch in WHITE_SPACE), hex(cp)


@pytest.mark.parametrize("text", TRICKY)
def test_gpt2_pattern_on_tricky_text(text):
    pieces = pretokenize_gpt2(text)
    assert "".join(pieces) == text
    assert pieces == _regex_package_split(text)
    assert pieces == _tokenizers_split(BYTE_LEVEL, text)


def test_gpt2_pattern_examples():
    assert pretokenize_gpt2("Hello, world!") == ["Hello", ",", " world", "!"]
    assert pretokenize_gpt2("a   b") == ["a", "  ", " b"]       # the last space goes with the word
    assert pretokenize_gpt2("I'm 2024") == ["I", "'m", " 2024"]


@pytest.mark.parametrize("name, text", list(shipped_texts().items()))
def test_gpt2_pattern_on_shipped_texts(name, text):
    pieces = pretokenize_gpt2(text)
    assert pieces == _regex_package_split(text)
    assert pieces == _tokenizers_split(BYTE_LEVEL, text)


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_gpt2_pattern_on_random_text(text):
    pieces = pretokenize_gpt2(text)
    assert "".join(pieces) == text
    assert pieces == _regex_package_split(text)


@settings(max_examples=200, deadline=None)
@given(TEXT)
def test_smollm2_pretokenizer_is_digits_then_byte_level(text):
    pieces = pretokenize_smollm2(text)
    assert "".join(pieces) == text
    assert pieces == _tokenizers_split(SMOLLM2, text)


def test_smollm2_pretokenizer_isolates_every_number_character():
    assert pretokenize_smollm2("in 2024!") == ["in", " ", "2", "0", "2", "4", "!"]
    assert pretokenize_smollm2("x½²") == ["x", "½", "²"]


def test_special_tokens_are_cut_out_whole_the_longest_first():
    eot, double = "<|endoftext|>", "<|endoftext|><|endoftext|>"
    text = f"a{eot}{eot}{eot}b"
    assert split_special_tokens(text, [eot, double]) == [("a", False), (double, True), (eot, True), ("b", False)]
    assert split_special_tokens(text, [double, eot]) == split_special_tokens(text, [eot, double])
    assert split_special_tokens(text, [eot]) == [("a", False), (eot, True), (eot, True), (eot, True), ("b", False)]
    assert split_special_tokens("a.b", ["."]) == [("a", False), (".", True), ("b", False)]   # escaped, not a wildcard
    assert split_special_tokens("abc", []) == [("abc", False)]
    assert split_special_tokens("", ["x"]) == []


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="text must be a str"):
        pretokenize_gpt2(b"bytes")
    with pytest.raises(TypeError, match="special_tokens must be a list of str"):
        split_special_tokens("a", "<|eot|>")
    with pytest.raises(TypeError, match="special_tokens must hold str"):
        split_special_tokens("a", [b"<|eot|>"])
    with pytest.raises(ValueError, match="empty string"):
        split_special_tokens("a", [""])


def test_byte_alphabet_round_trip():
    table = byte_alphabet.bytes_to_unicode()
    assert len(set(table.values())) == 256 and table[32] == "Ġ" and table[10] == "Ċ" and table[ord("a")] == "a"
    data = bytes(range(256))
    assert byte_alphabet.token_to_bytes(byte_alphabet.bytes_to_token(data)) == data
    with pytest.raises(ValueError, match="not in GPT-2's byte alphabet"):
        byte_alphabet.token_to_bytes(" ")
    with pytest.raises(TypeError):
        byte_alphabet.bytes_to_token("str")
