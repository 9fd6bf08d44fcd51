"""The BPE trainer: the incremental pair-count update gives exactly what a full recount per merge
gives (the key property, on random corpora full of ties); it learns ``tokenizers``' BpeTrainer merges
wherever no tie decides; ties go to the lexicographically greatest pair; special tokens are never
merged; the result does not depend on the order of the documents; bad input is named."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from llmu.tokenization import byte_alphabet, count_words, initial_vocab, train_bpe, train_bpe_from_file
from llmu.tokenization.bench import shipped_texts
from llmu.tokenization.pretokenize import pretokenize_smollm2

ESSAYS = shipped_texts()["essays.txt"]


def naive_train_bpe(text, vocab_size, special_tokens=(), pretokenizer=None):
    """The textbook trainer: recount every pair of every word before each merge. Also returns, for
    each merge, whether it was decided by a tie (another pair had the same count)."""
    kwargs = {} if pretokenizer is None else {"pretokenizer": pretokenizer}
    words = {tuple(bytes([b]) for b in w): n for w, n in count_words(text, special_tokens, **kwargs).items()}
    vocab = initial_vocab(special_tokens)
    merges, tied = [], []
    while len(vocab) < vocab_size:
        counts = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                counts[pair] += n
        if not counts:
            break
        best = max(counts, key=lambda p: (counts[p], p))
        tied.append(sum(c == counts[best] for c in counts.values()) > 1)
        merges.append(best)
        vocab[len(vocab)] = best[0] + best[1]
        new_words = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + n
        words = new_words
    return vocab, merges, tied


# Corpora with few letters: many words share pairs, so counts tie often and merges overlap ("aaa").
CORPUS = st.lists(st.text(alphabet=st.sampled_from(list("aab ba\n.é1")), max_size=12), max_size=30).map(" ".join)


@settings(max_examples=150, deadline=None)
@given(CORPUS, st.integers(257, 330), st.booleans())
def test_incremental_equals_full_recount(text, vocab_size, with_special):
    specials = ["<|eot|>"] if with_special else []
    if with_special:
        text = text.replace("\n", "<|eot|>")
    vocab, merges = train_bpe(text, vocab_size, specials)
    ref_vocab, ref_merges, _ = naive_train_bpe(text, vocab_size, specials)
    assert merges == ref_merges
    assert vocab == ref_vocab


@pytest.mark.parametrize("name", ["essays.txt", "preference_pairs.json"])
def test_incremental_equals_full_recount_on_shipped_text(name):
    text = shipped_texts()[name][:20000]
    assert train_bpe(text, 500)[1] == naive_train_bpe(text, 500)[1]


def test_incremental_equals_full_recount_with_smollm2_pretokenizer():
    text = shipped_texts()["sft_examples.json"][:8000]
    got = train_bpe(text, 400, pretokenizer=pretokenize_smollm2)[1]
    assert got == naive_train_bpe(text, 400, pretokenizer=pretokenize_smollm2)[1]


def _tokenizers_merges(text, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=0, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    import json

    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(byte_alphabet.token_to_bytes(t) for t in (m.split(" ") if isinstance(m, str) else m))
            for m in merges]


def test_same_merges_as_tokenizers_until_the_first_tie():
    """``tokenizers`` breaks ties otherwise (by the ids it gave the pieces): up to the first merge a
    tie decided, both trainers must learn the same merges in the same order."""
    _, merges, tied = naive_train_bpe(ESSAYS, 600)
    first_tie = tied.index(True)
    assert first_tie >= 30, "the comparison needs a corpus whose first merges are not ties"
    theirs = _tokenizers_merges(ESSAYS, 600)
    assert train_bpe(ESSAYS, 600)[1] == merges
    assert merges[:first_tie] == theirs[:first_tie]
    # after ties the order can differ, but most merges are the same ones
    assert len(set(merges) & set(theirs)) >= 0.9 * len(merges)


def test_ties_go_to_the_greatest_pair_of_byte_strings():
    # every pair occurs once: ("c", "d") > ("a", "b") > (" ", "c"), compared as bytes
    vocab, merges = train_bpe("ab cd", 257)
    assert merges == [(b"c", b"d")]
    assert train_bpe("ab cd", 259)[1] == [(b"c", b"d"), (b"a", b"b"), (b" ", b"cd")]
    # the left bytes decide first: after ("z", "z"), ("b", "a") beats ("a", "zz") and (" ", "a")
    assert train_bpe("ba azz", 258)[1] == [(b"z", b"z"), (b"b", b"a")]
    # a higher count beats any tie: ("a", "zz") occurs twice in "ba azz azz"
    assert train_bpe("ba azz azz", 259)[1] == [(b"z", b"z"), (b"a", b"zz"), (b" ", b"azz")]


def test_counts_are_weighted_by_word_frequency():
    # "xy" once but in 3 words' worth of occurrences against "ab" in one word twice
    text = "xy xy xy abab"
    merges = train_bpe(text, 257)[1]
    assert merges == [(b"x", b"y")]   # (x, y): 3; (a, b): 2; (" ", x): 2


def test_special_tokens_are_never_merged():
    eot = "<|eot|>"
    text = eot.join(["the cat", "the hat", "a cat"] * 20) + eot + eot
    vocab, merges = train_bpe(text, 400, [eot])
    assert vocab[256] == eot.encode()
    for a, b in merges:
        assert b"<" not in a + b and b"|" not in a + b, (a, b)
    assert list(vocab.values()).count(eot.encode()) == 1


def test_overlapping_special_tokens_are_cut_out_longest_first():
    eot, double = "<|endoftext|>", "<|endoftext|><|endoftext|>"
    words = count_words(f"a{eot}{eot}b{eot}c", [eot, double])
    assert words == Counter({b"a": 1, b"b": 1, b"c": 1})


def test_deterministic_and_independent_of_document_order():
    docs = ESSAYS.split("\n\n")
    eot = "<|endoftext|>"
    first = train_bpe(eot.join(docs), 500, [eot])
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    assert train_bpe(eot.join(docs), 500, [eot]) == first
    assert train_bpe(eot.join(shuffled), 500, [eot]) == first


def test_stops_when_nothing_is_left_to_merge():
    vocab, merges = train_bpe("aaaa", 10_000)
    assert merges == [(b"a", b"a"), (b"aa", b"aa")]
    assert len(vocab) == 258
    assert train_bpe("", 300) == (initial_vocab(), [])


def test_vocab_layout():
    vocab, merges = train_bpe(ESSAYS, 300, ["<|a|>", "<|b|>"])
    assert [vocab[i] for i in range(256)] == [bytes([i]) for i in range(256)]
    assert vocab[256] == b"<|a|>" and vocab[257] == b"<|b|>"
    assert len(vocab) == 300 and len(merges) == 300 - 258
    assert [vocab[258 + k] for k in range(len(merges))] == [a + b for a, b in merges]


def test_from_file_equals_from_text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(ESSAYS, encoding="utf-8")
    assert train_bpe_from_file(path, 320) == train_bpe(ESSAYS, 320)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="text must be a str"):
        train_bpe(b"abc", 300)
    with pytest.raises(ValueError, match="vocab_size must be at least 256 \\+ 1"):
        train_bpe("abc", 256, ["<|eot|>"])
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        train_bpe("abc", 300.0)
    with pytest.raises(TypeError, match="special_tokens must be a list of str"):
        train_bpe("abc", 300, "<|eot|>")
    with pytest.raises(TypeError, match="pretokenizer must be a function"):
        train_bpe("abc", 300, pretokenizer="gpt2")
    with pytest.raises(TypeError, match="path must be a str"):
        train_bpe_from_file(3, 300)
