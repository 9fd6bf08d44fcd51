"""Training a byte-level BPE tokenizer: which pairs of tokens to merge, in which order.

Byte-level BPE starts from the 256 possible bytes, so any text (any language, emoji, broken
UTF-8) can be written with the starting vocabulary. Training then repeats one step: **count every
pair of adjacent tokens in the corpus and merge the most frequent pair into a new token**, until
the vocabulary has ``vocab_size`` entries. The list of merges, in the order they were learned, is
the tokenizer: encoding replays them.

How the corpus is counted (:func:`count_words`):

1. special tokens (``"<|endoftext|>"``) are cut out first; they separate documents, take no part
   in counting, and so are never merged with anything: each gets one id of its own;
2. the text between them is pre-tokenised (GPT-2's pattern by default, see
   :mod:`llmu.tokenization.pretokenize`): merges never cross a pre-token boundary;
3. each distinct pre-token ("word") is kept once, as a tuple of token ids, with its count. A
   corpus of a few MB has a few tens of thousands of distinct words.

**Ties.** When several pairs have the same count, the merge is the *lexicographically greatest*
pair of byte strings, comparing ``(left bytes, right bytes)`` as tuples: between ``(b"a", b"b")``
and ``(b"a", b"c")`` it picks ``(b"a", b"c")``; between ``(b"b", b"a")`` and ``(b"a", b"zz")`` it
picks ``(b"b", b"a")``. That makes training deterministic (the same corpus always gives the same
merges), whatever order Python iterates dictionaries in.

**The incremental update.** A naive trainer recounts all pairs of all words after each merge:
``O(merges x corpus)``. But a merge of ``(a, b)`` only changes the words that contain ``a b``. The
trainer keeps

- ``pair_counts[pair]``: how often ``pair`` occurs, each word weighted by its count;
- ``pair_words[pair]``: the words that contain ``pair`` (an index from pair to words);
- a max-heap of ``(count, pair)`` entries, to find the best pair without scanning all of them.
  When a pair's count changes, a new entry is pushed; the stale ones are recognised when they
  reach the top (their count differs from ``pair_counts``) and dropped ("lazy invalidation").

and after merging ``(a, b)`` rewrites only ``pair_words[(a, b)]``: for each such word, the pairs
of its old spelling are subtracted and the pairs of its new spelling added. The result is exactly
the naive trainer's (the tests compare them on random corpora); the cost per merge is that of the
words it touches.

Vocabulary layout: ids 0..255 are the single bytes (id = byte value), then the special tokens in
the order given, then one id per merge in the order learned.
"""

from __future__ import annotations

import heapq
import os
from collections import Counter, defaultdict
from collections.abc import Sequence

from llmu.tokenization.pretokenize import Pretokenizer, _check_special_tokens, pretokenize_gpt2, split_special_tokens

__all__ = ["train_bpe", "train_bpe_from_file", "count_words", "initial_vocab"]

Merges = list[tuple[bytes, bytes]]


def initial_vocab(special_tokens: Sequence[str] = ()) -> dict[int, bytes]:
    """The 256 single bytes (id = byte value), then each special token's UTF-8 bytes."""
    vocab = {i: bytes([i]) for i in range(256)}
    for tok in _check_special_tokens(special_tokens):
        vocab[len(vocab)] = tok.encode("utf-8")
    return vocab


def count_words(text: str, special_tokens: Sequence[str] = (), pretokenizer: Pretokenizer = pretokenize_gpt2
                ) -> Counter[bytes]:
    """How often each pre-token occurs in ``text``, as UTF-8 bytes; special tokens are left out."""
    words: Counter[bytes] = Counter()
    for piece, is_special in split_special_tokens(text, special_tokens):
        if not is_special:
            words.update(p.encode("utf-8") for p in pretokenizer(piece))
    return words


def _check_args(text, vocab_size, special_tokens, pretokenizer):
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    special_tokens = _check_special_tokens(special_tokens)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size must be at least 256 + {len(special_tokens)} special tokens = "
                         f"{256 + len(special_tokens)}, got {vocab_size}")
    if not callable(pretokenizer):
        raise TypeError(f"pretokenizer must be a function str -> list[str], got {type(pretokenizer).__name__}")
    return special_tokens


class _Desc:
    """Wraps a pair's bytes so that a min-heap pops the *greatest* bytes first on equal counts."""

    __slots__ = ("key",)

    def __init__(self, key: tuple[bytes, bytes]):
        self.key = key

    def __lt__(self, other: _Desc) -> bool:
        return self.key > other.key


def _pairs(word: tuple[int, ...]) -> Counter[tuple[int, int]]:
    return Counter(zip(word, word[1:]))


def _merge_word(word: tuple[int, ...], a: int, b: int, new: int) -> tuple[int, ...]:
    """``word`` with every ``a b`` (left to right, not overlapping) replaced by ``new``."""
    out, i, n = [], 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def train_bpe(text: str, vocab_size: int, special_tokens: Sequence[str] = (), *,
              pretokenizer: Pretokenizer = pretokenize_gpt2) -> tuple[dict[int, bytes], Merges]:
    """Learn byte-level BPE on ``text`` until the vocabulary has ``vocab_size`` entries.

    Returns ``(vocab, merges)``: ``vocab`` maps id -> bytes (0..255 the bytes, then the special
    tokens, then the merged tokens); ``merges`` lists the learned pairs ``(left, right)`` in order.
    Training stops early when no pair is left (every word is one token). Ties between pairs of
    equal count go to the lexicographically greatest pair of byte strings.
    """
    special_tokens = _check_args(text, vocab_size, special_tokens, pretokenizer)
    vocab = initial_vocab(special_tokens)
    merges: Merges = []

    # The corpus as distinct words (tuples of byte ids) with their counts.
    counted = count_words(text, special_tokens, pretokenizer)
    words = [tuple(w) for w in counted]
    freqs = list(counted.values())

    # Pair counts over the corpus, and which words hold each pair.
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    pair_words: dict[tuple[int, int], set[int]] = defaultdict(set)
    for w, (word, freq) in enumerate(zip(words, freqs)):
        for pair, n in _pairs(word).items():
            pair_counts[pair] += n * freq
            pair_words[pair].add(w)

    def entry(pair):
        return (-pair_counts[pair], _Desc((vocab[pair[0]], vocab[pair[1]])), pair)

    heap = [entry(p) for p in pair_counts]
    heapq.heapify(heap)

    while len(vocab) < vocab_size:
        # The best pair: the top of the heap, once the stale entries are dropped.
        while heap:
            neg_count, _, pair = heap[0]
            if pair_counts.get(pair, 0) == -neg_count and neg_count < 0:
                break
            heapq.heappop(heap)
        if not heap:
            break  # nothing left to merge
        heapq.heappop(heap)
        a, b = pair
        new = len(vocab)
        vocab[new] = vocab[a] + vocab[b]
        merges.append((vocab[a], vocab[b]))

        # Rewrite only the words that contain the pair, and update the counts they change.
        changed: dict[tuple[int, int], int] = defaultdict(int)
        for w in pair_words.pop(pair):
            old, freq = words[w], freqs[w]
            merged = _merge_word(old, a, b, new)
            words[w] = merged
            old_pairs, new_pairs = _pairs(old), _pairs(merged)
            for p, n in old_pairs.items():
                changed[p] -= n * freq
                if p not in new_pairs and p != pair:
                    pair_words[p].discard(w)
            for p, n in new_pairs.items():
                changed[p] += n * freq
                pair_words[p].add(w)
        del pair_counts[pair]
        for p, delta in changed.items():
            if delta == 0 or p == pair:
                continue
            count = pair_counts.get(p, 0) + delta
            if count > 0:
                pair_counts[p] = count
                heapq.heappush(heap, entry(p))
            else:
                pair_counts.pop(p, None)
                pair_words.pop(p, None)
    return vocab, merges


def train_bpe_from_file(path: str | os.PathLike, vocab_size: int, special_tokens: Sequence[str] = (), *,
                        pretokenizer: Pretokenizer = pretokenize_gpt2) -> tuple[dict[int, bytes], Merges]:
    """:func:`train_bpe` on the UTF-8 text of the file at ``path``."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a path, got {type(path).__name__}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return train_bpe(text, vocab_size, special_tokens, pretokenizer=pretokenizer)
