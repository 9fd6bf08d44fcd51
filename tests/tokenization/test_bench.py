"""The ``bpe_train`` benchmark entry: registered for module 01 (tokenization comes before the
embeddings in the registry's order), runs both trainers on a small corpus and reports their times
and how far their merges agree."""

from __future__ import annotations

import pytest

from llmu.bench.registry import REGISTRY, TOPICS, load_all
from llmu.tokenization import bench, train_bpe


def test_registered_for_module_01():
    assert TOPICS.index("welcome") < TOPICS.index("tokenization") < TOPICS.index("embeddings")
    load_all()
    entry = REGISTRY["bpe_train"]
    assert entry is bench.BPE_TRAIN and entry.module == "01_embeddings" and entry.run is not None
    assert entry.cpu_sizes and entry.gpu_sizes


def test_corpus_is_the_shipped_texts_repeated():
    docs = bench.corpus_documents()
    assert len(docs) > 100
    small = bench.corpus(0.01)
    assert list(small) == list(docs[:len(small)])
    big = bench.corpus(1.0)
    assert sum(len(d.encode()) for d in big) >= 0.99e6 and big[len(docs)] == docs[0]
    with pytest.raises(ValueError, match="mb must be a positive number"):
        bench.corpus(0)


def test_agreement():
    a, b, c = (b"a", b"b"), (b"c", b"d"), (b"e", b"f")
    assert bench.agreement([a, b, c], [a, b, c], 3) == {"merges_same_prefix": 3, "merges_agree": 1.0, "merges_compared": 3}
    got = bench.agreement([a, b, c], [a, c, b], 2)
    assert got["merges_same_prefix"] == 1 and got["merges_agree"] == 0.5


def test_run_gives_a_row_per_trainer():
    rows = bench._run({"mb": 0.03, "vocab": 400, "repeats": 1, "compare": 100}, "cpu")
    assert [r["provider"] for r in rows] == ["llmu", "tokenizers"]
    for r in rows:
        assert r["ms"] > 0 and r["mb_per_s"] > 0 and r["megabytes"] >= 0.03
        assert 0.8 <= r["merges_agree"] <= 1.0 and r["merges_compared"] == 100
    assert rows[1]["speedup"] == 1.0 and rows[0]["ratio_to"] == "tokenizers"
    assert rows[0]["speedup"] == pytest.approx(1 / rows[0]["ratio"])


def test_tokenizers_merges_match_llmus_until_the_first_tie():
    docs = bench.corpus(0.03)
    ours = train_bpe(bench.EOT.join(docs), 300, [bench.EOT])[1]
    theirs = bench.tokenizers_train_bpe(docs, 300)
    assert len(ours) == len(theirs) == 300 - 257
    assert bench.agreement(ours, theirs, 43)["merges_same_prefix"] >= 10
