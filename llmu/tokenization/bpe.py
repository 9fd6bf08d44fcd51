"""A byte-level BPE tokenizer built from a vocabulary and a list of merges.

``BPETokenizer(vocab, merges, special_tokens)`` takes what :func:`llmu.tokenization.train_bpe`
returns (or what a model ships: :mod:`llmu.tokenization.smollm2` loads SmolLM2's):

- ``vocab``: id -> bytes;
- ``merges``: pairs of byte strings, in the order they were learned (the *rank* of a merge is its
  place in this list: lower ranks were more frequent in training and are applied first);
- ``special_tokens``: strings that are always one token, never split or merged with their
  neighbours (``"<|endoftext|>"``); those not in ``vocab`` yet get the next free ids.

**Encoding** text:

1. cut out the special tokens (the longest first, where one contains another);
2. pre-tokenise the text between them (GPT-2's pattern by default; SmolLM2 has its own, see
   :mod:`llmu.tokenization.pretokenize`);
3. inside each pre-token, start from its UTF-8 bytes (one token each) and apply merges *by rank*:
   find the adjacent pair with the lowest rank, merge every occurrence of it (left to right), and
   repeat until no adjacent pair is a merge. Merges apply in the order training learned them,
   not from left to right in the text, so each pre-token ends up as the tokens training built
   for it;
4. look each resulting byte string up in ``vocab``.

A pre-token's ids depend only on its text, so they are kept in a small cache: real text repeats
its words.

**Decoding** joins the tokens' bytes and reads them as UTF-8. A token can hold part of a
character (one byte of "é"), so a list of ids cut at the wrong place is not valid UTF-8: such bytes
become U+FFFD ("�") instead of an error (``errors="replace"``).

**Streaming** (:meth:`BPETokenizer.encode_iterable`): a file read line by line is encoded piece
by piece, with memory that does not grow with the file. The only care: a pre-token or a special
token may continue in the next piece of text, so the tail of each piece that could still change
(the last pre-token, or the start of a special token) is held back and encoded with what follows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence

from llmu.tokenization.byte_alphabet import bytes_to_token, merge_to_bytes, token_to_bytes
from llmu.tokenization.pretokenize import Pretokenizer, _check_special_tokens, pretokenize_gpt2, split_special_tokens

__all__ = ["BPETokenizer"]

#: How many pre-tokens' ids the cache keeps before it starts over (so memory stays bounded).
CACHE_SIZE = 1 << 16


class BPETokenizer:
    """Text <-> ids with byte-level BPE: ``encode``, ``decode`` and a streaming ``encode_iterable``."""

    def __init__(self, vocab: Mapping[int, bytes], merges: Sequence[tuple[bytes, bytes]],
                 special_tokens: Sequence[str] | None = None, *, pretokenizer: Pretokenizer = pretokenize_gpt2):
        if not isinstance(vocab, Mapping):
            raise TypeError(f"vocab must be a dict of id -> bytes, got {type(vocab).__name__}")
        if not callable(pretokenizer):
            raise TypeError(f"pretokenizer must be a function str -> list[str], got {type(pretokenizer).__name__}")
        self.vocab: dict[int, bytes] = {}
        self._id_of: dict[bytes, int] = {}
        for i, tok in vocab.items():
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise TypeError(f"vocab ids must be non-negative ints, got {i!r}")
            if not isinstance(tok, (bytes, bytearray)):
                raise TypeError(f"vocab[{i}] must be bytes, got {type(tok).__name__}")
            tok = bytes(tok)
            if tok in self._id_of:
                raise ValueError(f"vocab has {tok!r} twice: ids {self._id_of[tok]} and {i}")
            self.vocab[i] = tok
            self._id_of[tok] = i
        # Byte-level BPE starts from single bytes. A vocabulary may lack a few that its training
        # text never had (SmolLM2's has no token for 0x04 or 0xff); text with such a byte cannot be
        # encoded, and encode says so rather than dropping it.
        self._byte_ids = [self._id_of.get(bytes([b])) for b in range(256)]

        # Special tokens: their id in vocab, or the next free ids.
        self.special_tokens: dict[str, int] = {}
        for tok in _check_special_tokens(special_tokens):
            data = tok.encode("utf-8")
            if data not in self._id_of:
                new = max(self.vocab) + 1
                self.vocab[new] = data
                self._id_of[data] = new
            self.special_tokens[tok] = self._id_of[data]
        self._special_list = tuple(self.special_tokens)

        # Merges as ids: (left id, right id) -> (rank, merged id).
        if isinstance(merges, (str, bytes)) or not isinstance(merges, Sequence):
            raise TypeError(f"merges must be a list of (bytes, bytes) pairs, got {type(merges).__name__}")
        self.merges: list[tuple[bytes, bytes]] = []
        self._ranks: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, pair in enumerate(merges):
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(p, (bytes, bytearray)) for p in pair)):
                raise TypeError(f"merges[{rank}] must be a pair of bytes, got {pair!r}")
            a, b = bytes(pair[0]), bytes(pair[1])
            for part in (a, b, a + b):
                if part not in self._id_of:
                    raise ValueError(f"merges[{rank}] = {pair!r}: {part!r} is not in vocab")
            key = (self._id_of[a], self._id_of[b])
            if key not in self._ranks:  # a repeated merge could never apply a second time
                self._ranks[key] = (rank, self._id_of[a + b])
            self.merges.append((a, b))
        self.pretokenizer = pretokenizer
        self._cache: dict[str, tuple[int, ...]] = {}

    # -- construction from files ------------------------------------------------------------------
    @classmethod
    def from_vocab_merges(cls, vocab: Mapping[str, int], merges: Sequence[str | tuple[str, str]],
                          special_tokens: Sequence[str] | None = None, *,
                          pretokenizer: Pretokenizer = pretokenize_gpt2) -> BPETokenizer:
        """From a vocabulary and merges written in GPT-2's byte alphabet (see
        :mod:`llmu.tokenization.byte_alphabet`), as ``vocab.json``/``merges.txt``, ``tokenizer.json``
        and GGUF files hold them: ``{"Ġthe": 262, ...}`` and ``["Ġ t", "h e", ...]`` (or pairs).
        Special tokens are stored as plain text; their ids come from ``vocab`` when they are in it."""
        if not isinstance(vocab, Mapping):
            raise TypeError(f"vocab must be a dict of token -> id, got {type(vocab).__name__}")
        specials = set(_check_special_tokens(special_tokens))
        as_bytes = {i: (tok.encode("utf-8") if tok in specials else token_to_bytes(tok)) for tok, i in vocab.items()}
        pairs = []
        for k, m in enumerate(merges):
            try:
                pairs.append(merge_to_bytes(m))
            except (TypeError, ValueError) as e:
                raise type(e)(f"merges[{k}]: {e}") from None
        return cls(as_bytes, pairs, special_tokens, pretokenizer=pretokenizer)

    @classmethod
    def from_files(cls, vocab_path: str | os.PathLike, merges_path: str | os.PathLike,
                   special_tokens: Sequence[str] | None = None, *,
                   pretokenizer: Pretokenizer = pretokenize_gpt2) -> BPETokenizer:
        """From GPT-2-style files: ``vocab.json`` (token -> id) and ``merges.txt`` (one ``"left
        right"`` per line; a first line ``#version...`` and blank lines are skipped)."""
        with open(vocab_path, encoding="utf-8") as f:
            vocab = json.load(f)
        with open(merges_path, encoding="utf-8") as f:
            lines = [ln.rstrip("\n") for ln in f]
        merges = [ln for k, ln in enumerate(lines) if ln and not (k == 0 and ln.startswith("#version"))]
        return cls.from_vocab_merges(vocab, merges, special_tokens, pretokenizer=pretokenizer)

    def save(self, vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> None:
        """Write ``vocab.json`` and ``merges.txt`` that :meth:`from_files` reads back."""
        specials = {tok.encode("utf-8") for tok in self.special_tokens}
        vocab = {(tok.decode("utf-8") if tok in specials else bytes_to_token(tok)): i for i, tok in self.vocab.items()}
        with open(vocab_path, "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False, indent=0)
        with open(merges_path, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n")
            for a, b in self.merges:
                f.write(f"{bytes_to_token(a)} {bytes_to_token(b)}\n")

    # -- encoding ---------------------------------------------------------------------------------
    def _bpe(self, piece: str) -> tuple[int, ...]:
        """The ids of one pre-token: its bytes, merged by rank."""
        data = piece.encode("utf-8")
        ids = [self._byte_ids[b] for b in data]  # a byte's id need not be its value
        if None in ids:
            b = data[ids.index(None)]
            raise ValueError(f"text holds the byte 0x{b:02x} (in {piece!r}), which has no token in this vocabulary")
        ranks = self._ranks
        while len(ids) > 1:
            best = None
            for pair in zip(ids, ids[1:]):
                found = ranks.get(pair)
                if found is not None and (best is None or found[0] < best[0]):
                    best, best_pair = found, pair
            if best is None:
                break
            a, b = best_pair
            merged, i = [], 0
            while i < len(ids):
                if i + 1 < len(ids) and ids[i] == a and ids[i + 1] == b:
                    merged.append(best[1])
                    i += 2
                else:
                    merged.append(ids[i])
                    i += 1
            ids = merged
        return tuple(ids)

    def _encode_pretoken(self, piece: str) -> tuple[int, ...]:
        ids = self._cache.get(piece)
        if ids is None:
            if len(self._cache) >= CACHE_SIZE:
                self._cache.clear()
            ids = self._cache[piece] = self._bpe(piece)
        return ids

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``; special tokens written in it are single ids."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids: list[int] = []
        for piece, is_special in split_special_tokens(text, self._special_list):
            if is_special:
                ids.append(self.special_tokens[piece])
            else:
                for pre in self.pretokenizer(piece):
                    ids.extend(self._encode_pretoken(pre))
        return ids

    def _final_length(self, text: str) -> int:
        """How much of ``text`` encodes the same whatever text follows it."""
        cut = len(text)
        # 1. Hold back a tail that more text could turn into a special token: "<|endof" now,
        #    "<|endoftext|>" later (or a whole "<|endoftext|>" that a longer special token starts with).
        longest = max((len(t) for t in self._special_list), default=0)
        for start in range(max(0, len(text) - longest + 1), len(text)):
            tail = text[start:]
            if any(t != tail and t.startswith(tail) for t in self._special_list):
                cut = start
                break
        # 2. Find the piece (special token or text) that ends at or spans the cut.
        pos = 0
        for piece, is_special in split_special_tokens(text, self._special_list):
            end = pos + len(piece)
            if end >= cut:
                if is_special:  # never cut a special token the whole text matched
                    return cut if end == cut else pos
                # 3. In text, hold back the last pre-token: "the ca" may go on as "the cat".
                last = self.pretokenizer(text[pos:cut])
                return cut - len(last[-1]) if last else cut
            pos = end
        return cut

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Ids of the concatenation of the strings of ``iterable`` (lines of a file, say), yielded
        as soon as they are final: equal to ``encode("".join(iterable))``, in memory that does not
        grow with the input (the text held back is at most about one pre-token and one line)."""
        if isinstance(iterable, str) or not isinstance(iterable, Iterable):
            raise TypeError(f"iterable must be an iterable of str (an open file, a list of lines), "
                            f"got {type(iterable).__name__}")
        held = ""
        for chunk in iterable:
            if not isinstance(chunk, str):
                raise TypeError(f"iterable must yield str, got {type(chunk).__name__}")
            held += chunk
            cut = self._final_length(held)
            if cut:
                yield from self.encode(held[:cut])
                held = held[cut:]
        if held:
            yield from self.encode(held)

    # -- decoding ---------------------------------------------------------------------------------
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of ``ids``, joined."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        out = []
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypeError(f"ids must be ints, got {type(i).__name__} {i!r}")
            tok = self.vocab.get(i)
            if tok is None:
                raise ValueError(f"id {i} is not in the vocabulary ({len(self.vocab)} tokens)")
            out.append(tok)
        return b"".join(out)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``: their bytes as UTF-8, an incomplete character shown as U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __repr__(self) -> str:
        return (f"BPETokenizer(vocab_size={len(self.vocab)}, merges={len(self.merges)}, "
                f"special_tokens={list(self.special_tokens)})")
