"""``BPETokenizer``: built from a trained ``(vocab, merges, special_tokens)`` it encodes exactly as
the ``tokenizers`` library's BPE with the same merges; decode inverts encode on any text; merges
apply by rank; overlapping special tokens encode as the longest; ``encode_iterable`` equals
``encode`` however the text is cut, reads its input lazily and holds a bounded amount of memory."""

from __future__ import annotations

import itertools
import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from llmu.tokenization import BPETokenizer, bytes_to_token, train_bpe
from llmu.tokenization.bench import shipped_texts

EOT, DOUBLE = "<|endoftext|>", "<|endoftext|><|endoftext|>"
TEXTS = shipped_texts()


@pytest.fixture(scope="module")
def trained():
    vocab, merges = train_bpe(TEXTS["essays.txt"] + EOT + TEXTS["sft_examples.json"], 700, [EOT])
    return vocab, merges


@pytest.fixture(scope="module")
def tok(trained):
    return BPETokenizer(*trained, [EOT, DOUBLE])


@pytest.fixture(scope="module")
def oracle(trained):
    """``tokenizers``' BPE with the same vocabulary and merges, ByteLevel pre-tokenizer, and the
    special tokens as added tokens."""
    vocab, merges = trained
    as_str = {(EOT if b == EOT.encode() else bytes_to_token(b)): i for i, b in vocab.items()}
    backend = Tokenizer(models.BPE(vocab=as_str, merges=[(bytes_to_token(a), bytes_to_token(b)) for a, b in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(EOT, special=True, normalized=False),
                                AddedToken(DOUBLE, special=True, normalized=False)])
    return backend


def _oracle_ids(oracle, tok, text):
    """tokenizers' ids, with its ids of the special tokens mapped to ours."""
    ids = oracle.encode(text, add_special_tokens=False).ids
    remap = {oracle.token_to_id(s): i for s, i in tok.special_tokens.items()}
    return [remap.get(i, i) for i in ids]


@pytest.mark.parametrize("name", list(TEXTS))
def test_encode_equals_tokenizers_on_shipped_texts(name, tok, oracle):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert ids == _oracle_ids(oracle, tok, text)
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_round_trip_and_tokenizers_on_random_unicode(tok, oracle, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == _oracle_ids(oracle, tok, text)


def test_overlapping_special_tokens_encode_as_the_longest(tok, oracle):
    eot, double = tok.special_tokens[EOT], tok.special_tokens[DOUBLE]
    assert eot != double
    text = f"a{EOT}{EOT}{EOT}b"
    ids = tok.encode(text)
    assert ids[1:3] == [double, eot]
    assert ids == _oracle_ids(oracle, tok, text)
    assert tok.decode(ids) == text


def test_special_tokens_keep_their_vocab_id_or_get_new_ones(trained):
    vocab, merges = trained
    tok = BPETokenizer(vocab, merges, [EOT, "<|new|>"])
    assert tok.special_tokens[EOT] == 256          # already in vocab
    assert tok.special_tokens["<|new|>"] == len(vocab)   # the next free id
    assert tok.encode("x<|new|>") == tok.encode("x") + [len(vocab)]
    # without being declared special, "<|new|>" is ordinary text
    assert len(BPETokenizer(vocab, merges).encode("<|new|>")) > 1


def test_merges_apply_by_rank_not_left_to_right():
    vocab = {i: bytes([i]) for i in range(256)}
    vocab.update({256: b"bc", 257: b"ab"})
    tok = BPETokenizer(vocab, [(b"b", b"c"), (b"a", b"b")])
    assert tok.encode("abc") == [ord("a"), 256]          # "a" "bc": rank 0 first
    tok = BPETokenizer(vocab, [(b"a", b"b"), (b"b", b"c")])
    assert tok.encode("abc") == [257, ord("c")]          # "ab" "c"
    vocab[258] = b"aa"
    vocab[259] = b"aaaa"
    tok = BPETokenizer(vocab, [(b"a", b"a"), (b"aa", b"aa")])
    assert tok.encode("aaaaa") == [259, ord("a")]       # every "a a" merged, left to right


def test_decode_replaces_broken_utf8(tok):
    e_acute = "é".encode()
    half = tok.encode("é")
    assert tok.decode_bytes(half) == e_acute
    assert tok.decode([e_acute[0]]) == "\ufffd"
    assert tok.decode([e_acute[0], ord("a")]) == "\ufffda"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["a", " ", "  ", "the", " cat", "\n", "2024", "é", EOT, EOT[:5], EOT[5:], "<", "|"]),
                max_size=30),
       st.lists(st.integers(0, 40), max_size=6))
def test_encode_iterable_equals_encode_however_the_text_is_cut(tok, parts, cuts):
    text = "".join(parts)
    points = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    assert list(tok.encode_iterable(chunks)) == tok.encode(text)
    assert list(tok.encode_iterable(iter(parts))) == tok.encode(text)


def test_encode_iterable_on_a_file(tok, tmp_path):
    text = TEXTS["luke_kjv.txt"][:30000]
    path = tmp_path / "luke.txt"
    path.write_text(text, encoding="utf-8")
    with open(path, encoding="utf-8") as f:
        assert list(tok.encode_iterable(f)) == tok.encode(text)


def test_encode_iterable_is_lazy(tok):
    """An endless input: the first ids come out without reading it all."""
    endless = itertools.cycle(["the cat sat\n", f"on the mat{EOT}"])
    first = list(itertools.islice(tok.encode_iterable(endless), 50))
    assert first == tok.encode(("the cat sat\n" + f"on the mat{EOT}") * 10)[:50]


def _lines(count: int):
    for k in range(count):
        yield f"line {k % 97}: the quick brown fox{EOT if k % 5 == 0 else ''}\n"


def _peak_bytes(tok, lines: int) -> int:
    """Peak memory Python allocates while ``encode_iterable`` consumes ``lines`` lines (the ids are
    dropped as they come), the pre-token cache filled beforehand."""
    for _ in tok.encode_iterable(_lines(200)):
        pass
    tracemalloc.start()
    try:
        for _ in tok.encode_iterable(_lines(lines)):
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_encode_iterable_memory_does_not_grow_with_the_input(tok):
    small, large = _peak_bytes(tok, 500), _peak_bytes(tok, 20000)
    assert large < 1.5 * small + 20_000, (small, large)
    whole = "".join(_lines(20000))            # about 0.8 MB of text, 200k ids at once: megabytes
    assert large < len(whole) / 20, (large, len(whole))


def test_save_and_from_files_round_trip(tok, tmp_path):
    tok.save(tmp_path / "vocab.json", tmp_path / "merges.txt")
    again = BPETokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", [EOT, DOUBLE])
    assert again.vocab == tok.vocab and again.merges == tok.merges and again.special_tokens == tok.special_tokens
    text = TEXTS["essays.txt"][:5000] + DOUBLE
    assert again.encode(text) == tok.encode(text)


def test_from_vocab_merges_reads_the_byte_alphabet():
    vocab = {bytes_to_token(bytes([i])): i for i in range(256)}
    vocab.update({"Ġt": 256, "<|eot|>": 257})
    tok = BPETokenizer.from_vocab_merges(vocab, ["Ġ t"], ["<|eot|>"])
    assert tok.vocab[256] == b" t" and tok.encode(" t<|eot|>") == [256, 257]
    with pytest.raises(ValueError, match="two tokens separated by one space"):
        BPETokenizer.from_vocab_merges(vocab, ["Ġt"])


def test_bad_input_is_named(trained):
    vocab, merges = trained
    with pytest.raises(TypeError, match="vocab must be a dict"):
        BPETokenizer(list(vocab.values()), merges)
    with pytest.raises(TypeError, match="vocab\\[1\\] must be bytes"):
        BPETokenizer({**vocab, 1: "a"}, merges)
    with pytest.raises(ValueError, match="twice"):
        BPETokenizer({**vocab, 5000: b"a"}, merges)
    with pytest.raises(ValueError, match="merges\\[1\\].*not in vocab"):
        BPETokenizer(vocab, [merges[0], (b"zzz", b"q")])
    with pytest.raises(TypeError, match="merges\\[0\\] must be a pair of bytes"):
        BPETokenizer(vocab, [("a", "b")])
    tok = BPETokenizer(vocab, merges)
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(b"abc")
    with pytest.raises(ValueError, match="id 99999 is not in the vocabulary"):
        tok.decode([1, 99999])
    with pytest.raises(TypeError, match="ids must be ints"):
        tok.decode(["a"])
    with pytest.raises(TypeError, match="iterable must be an iterable of str"):
        list(tok.encode_iterable("a string"))
    small = {i: bytes([i]) for i in range(256) if i != 0xC3}   # no token for 0xc3, the first byte of "é"
    with pytest.raises(ValueError, match="byte 0xc3"):
        BPETokenizer(small, []).encode("café")
