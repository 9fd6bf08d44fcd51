"""Pre-tokenisation: cutting text into the pieces ("pre-tokens") that BPE works inside.

BPE never merges across a pre-token boundary. Cutting first keeps tokens sensible (" dog." does
not become one token: " dog" and "." are separate pieces) and keeps training cheap (the trainer
counts each distinct piece once, with its frequency).

**GPT-2's pattern.** GPT-2 cuts text with one regular expression, tried left to right::

    '(?:[sdmt]|ll|ve|re)| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+

in words: English contractions ('s 't 're 've 'm 'll 'd); a run of letters with at most one
space in front (" the"); a run of digits with its space; a run of other symbols with its space
(" .", "!!"); whitespace not followed by a non-space (so that the last space before a word stays
with the word: "a   b" -> "a", "  ", " b"); other whitespace. ``\\p{L}`` is any Unicode letter,
``\\p{N}`` any Unicode number, ``\\s`` Unicode white space.

Python's own ``re`` has no ``\\p{...}`` classes, so :func:`gpt2_regex` spells them out: it reads
the Unicode database of this Python (:mod:`unicodedata`) once and writes each class as a list of
code-point ranges (letters: general category L*, numbers: N*, white space: Unicode's White_Space
list). The compiled pattern then behaves like the ``\\p{}`` version of the ``regex`` package or of
the ``tokenizers`` library (the tests compare them), for every character that this Python's Unicode
version has assigned (``unicodedata.unidata_version``; newer ones count as symbols here).

**SmolLM2's pre-tokeniser** (``tokenizer.ggml.pre = "smollm"``) first isolates every number
character (each digit its own piece: numbers are read digit by digit), then applies GPT-2's
pattern to what lies between: :func:`pretokenize_smollm2`.

**Special tokens** (``"<|endoftext|>"``) are cut out *before* pre-tokenisation and are never
merged or split: :func:`split_special_tokens`. When one special token contains another
(``"<|endoftext|><|endoftext|>"`` and ``"<|endoftext|>"``), the longest one that matches wins.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache

__all__ = ["GPT2_PATTERN", "WHITE_SPACE", "Pretokenizer", "gpt2_regex", "pretokenize_gpt2", "pretokenize_smollm2",
           "special_tokens_regex", "split_special_tokens"]

#: GPT-2's pre-tokenisation pattern as published (``\p{}`` classes: the ``regex`` package's syntax).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

#: Unicode's White_Space property (what ``\s`` means in the ``regex`` package and in the
#: ``tokenizers`` library). Python's ``str.isspace`` also counts U+001C..U+001F, which are not in it.
WHITE_SPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
               "\u2028\u2029\u202f\u205f\u3000")

#: A pre-tokeniser: text -> its pieces, in order (joined, they give the text back).
Pretokenizer = Callable[[str], list[str]]


def _ranges(codepoints: Iterable[int]) -> str:
    """A regex character-class body listing ``codepoints`` (sorted) as ``a-b`` ranges."""
    parts, start, prev = [], None, None
    for cp in codepoints:
        if prev is not None and cp == prev + 1:
            prev = cp
            continue
        if start is not None:
            parts.append(_span(start, prev))
        start = prev = cp
    if start is not None:
        parts.append(_span(start, prev))
    return "".join(parts)


def _span(a: int, b: int) -> str:
    return re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"


@lru_cache(maxsize=1)
def _unicode_classes() -> tuple[str, str, str]:
    """Character-class bodies for ``\\p{L}``, ``\\p{N}`` and ``\\s`` (read once, about 0.3 s)."""
    letters, numbers = [], []
    for cp in range(sys.maxunicode + 1):
        cat = unicodedata.category(chr(cp))[0]
        if cat == "L":
            letters.append(cp)
        elif cat == "N":
            numbers.append(cp)
    return _ranges(letters), _ranges(numbers), _ranges(sorted(map(ord, WHITE_SPACE)))


@lru_cache(maxsize=1)
def gpt2_regex() -> re.Pattern:
    """:data:`GPT2_PATTERN` compiled with Python's ``re``, the ``\\p{}`` classes spelled out."""
    L, N, S = _unicode_classes()
    pattern = (rf"'(?:[sdmt]|ll|ve|re)| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+|[{S}]+(?![^{S}])|[{S}]+")
    return re.compile(pattern)


def _check_text(text) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return text


def pretokenize_gpt2(text: str) -> list[str]:
    """``text`` cut with GPT-2's pattern: ``"Hello, world!"`` -> ``["Hello", ",", " world", "!"]``."""
    return gpt2_regex().findall(_check_text(text))


@lru_cache(maxsize=1)
def _number_char() -> re.Pattern:
    """One Unicode number character (general category N*: "7", "²", "½", "٣")."""
    return re.compile(f"[{_unicode_classes()[1]}]")


def pretokenize_smollm2(text: str) -> list[str]:
    """SmolLM2's pre-tokeniser: every number character on its own, GPT-2's pattern in between.

    ``"in 2024!"`` -> ``["in", " ", "2", "0", "2", "4", "!"]`` (GPT-2's pattern alone gives
    ``["in", " 2024", "!"]``).
    """
    text = _check_text(text)
    pieces, start = [], 0
    for m in _number_char().finditer(text):
        if m.start() > start:
            pieces += gpt2_regex().findall(text, start, m.start())
        pieces.append(m.group())
        start = m.end()
    if start < len(text):
        pieces += gpt2_regex().findall(text, start)
    return pieces


def _check_special_tokens(special_tokens) -> tuple[str, ...]:
    if special_tokens is None:
        return ()
    if isinstance(special_tokens, str) or not isinstance(special_tokens, Iterable):
        raise TypeError(f"special_tokens must be a list of str, got {type(special_tokens).__name__}")
    out = []
    for tok in special_tokens:
        if not isinstance(tok, str):
            raise TypeError(f"special_tokens must hold str, got {type(tok).__name__} {tok!r}")
        if not tok:
            raise ValueError("special_tokens: the empty string cannot be a special token")
        if tok not in out:
            out.append(tok)
    return tuple(out)


@lru_cache(maxsize=64)
def _special_regex(special_tokens: tuple[str, ...]) -> re.Pattern | None:
    if not special_tokens:
        return None
    # Longest first: regex alternation takes the first alternative that matches, so
    # "<|endoftext|><|endoftext|>" must be tried before "<|endoftext|>".
    ordered = sorted(special_tokens, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in ordered))


def special_tokens_regex(special_tokens: Sequence[str]) -> re.Pattern | None:
    """A compiled pattern matching any of ``special_tokens`` (the longest first); ``None`` if none."""
    return _special_regex(_check_special_tokens(special_tokens))


def split_special_tokens(text: str, special_tokens: Sequence[str] | None) -> list[tuple[str, bool]]:
    """``text`` as ``(piece, is_special)`` pairs: every special token whole, the text between it.

    ``split_special_tokens("a<|eot|>b", ["<|eot|>"])`` -> ``[("a", False), ("<|eot|>", True), ("b", False)]``.
    Empty text pieces are left out. Where special tokens overlap, the longest match wins.
    """
    text = _check_text(text)
    pattern = special_tokens_regex(special_tokens)
    if pattern is None:
        return [(text, False)] if text else []
    out, start = [], 0
    for m in pattern.finditer(text):
        if m.start() > start:
            out.append((text[start:m.start()], False))
        out.append((m.group(), True))
        start = m.end()
    if start < len(text):
        out.append((text[start:], False))
    return out
