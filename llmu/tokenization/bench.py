"""Benchmark of module 01's tokenization: training byte-level BPE, llmu against ``tokenizers``.

``bpe_train`` (a ``run=`` entry, :func:`compare_training`): the texts llmu ships (``llmu/data``:
the ``.txt`` files and the strings of the ``.json`` files, each one document) repeated to about
``mb`` megabytes, documents separated by ``<|endoftext|>``, trained to a vocabulary of ``vocab``
tokens by

- ``llmu``: :func:`llmu.tokenization.train_bpe` (pure Python, the incremental pair-count update);
- ``tokenizers``: the ``tokenizers`` library's ``BpeTrainer`` (Rust), with GPT-2's byte alphabet
  as its initial alphabet, its ByteLevel pre-tokenizer (GPT-2's pattern) and the same special
  token. It does not cut special tokens out of training text, so it is handed the documents one
  by one (the cutting is part of llmu's time, a small part).

Each provider's figure is the wall time of one training, from text to merges, called in turn
(``repeats`` rounds, :func:`llmu.bench.interleave`); rows carry the median, spread, MB/s, the
paired ratio of the times (``ratio``: llmu's seconds over ``tokenizers``', round by round) and
``speedup``, its inverse (below 1: llmu is slower).

How far the two agree: the trainers break ties differently (llmu: the greatest pair of byte
strings; ``tokenizers``: by the ids it gave the pieces), and after the first tie their merges may
come in another order, or differ a little. Each row has ``merges_same_prefix`` (how many merges,
from the first, are identical and in the same order) and ``merges_agree`` (the fraction of
llmu's first ``compare`` merges that are among ``tokenizers``' first ``compare``).

Repeating a text does not add distinct words, only counts: the word-count step grows with the
megabytes, the merge loop with the distinct words. The shipped texts hold about 0.18 MB of
distinct text, whose words are all single tokens after about 6,900 merges: the vocabularies here
(2,048 and 4,096) stay below that, so both trainers make every merge asked for. A corpus of new
text per megabyte would make the merge loop longer for both.
"""

from __future__ import annotations

import json
from functools import lru_cache

from llmu import data
from llmu.bench.paired import interleave, timed
from llmu.bench.registry import Entry, register
from llmu.tokenization.byte_alphabet import merge_to_bytes
from llmu.tokenization.train_bpe import train_bpe

__all__ = ["BPE_TRAIN", "shipped_texts", "shipped_strings", "corpus_documents", "corpus", "tokenizers_train_bpe", "compare_training", "agreement"]

MODULE = "01_embeddings"
EOT = "<|endoftext|>"


def _strings(x):
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)


def shipped_texts() -> dict[str, str]:
    """file name -> text of everything llmu ships in ``llmu/data``: each ``.txt`` file whole, and
    each ``.json`` file's strings joined by newlines (the tokenization tests encode all of them)."""
    out = {f"{name}.txt": data.text(name) for name in data.names()}
    for name in data.json_names():
        out[f"{name}.json"] = "\n".join(_strings(data.json(name)))
    return out


def shipped_strings() -> list[str]:
    """Every non-blank string of the ``.json`` files in ``llmu/data``, one by one."""
    return [s for name in data.json_names() for s in _strings(data.json(name)) if s.strip()]


@lru_cache(maxsize=1)
def corpus_documents() -> tuple[str, ...]:
    """The shipped texts as documents: each ``.txt`` file, and each string of the ``.json`` files."""
    return tuple([data.text(name) for name in data.names()] + shipped_strings())


def corpus(mb: float) -> list[str]:
    """The documents repeated until their UTF-8 size reaches ``mb`` megabytes."""
    if not isinstance(mb, (int, float)) or isinstance(mb, bool) or mb <= 0:
        raise ValueError(f"mb must be a positive number, got {mb!r}")
    docs, size, out = corpus_documents(), 0, []
    while size < mb * 1e6:
        for d in docs:
            out.append(d)
            size += len(d.encode("utf-8")) + len(EOT)
            if size >= mb * 1e6:
                break
    return out


def tokenizers_train_bpe(documents: list[str], vocab_size: int, special_tokens=(EOT,)) -> list[tuple[bytes, bytes]]:
    """``tokenizers``' ``BpeTrainer`` on ``documents``: its merges, as pairs of bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=0, show_progress=False,
                                  special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer)
    return [merge_to_bytes(m) for m in json.loads(tok.to_str())["model"]["merges"]]


def agreement(ours: list, theirs: list, compare: int) -> dict:
    """``merges_same_prefix`` and ``merges_agree`` (see the module's docstring)."""
    prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    n = min(compare, len(ours))
    agree = len(set(ours[:n]) & set(theirs[:compare])) / n if n else 1.0
    return {"merges_same_prefix": prefix, "merges_agree": agree, "merges_compared": n}


def compare_training(mb: float, vocab_size: int, repeats: int = 3, compare: int = 500):
    """Both trainers on :func:`corpus` ``(mb)``, in turn: ``(Paired, agreement dict, megabytes)``."""
    docs = corpus(mb)
    text = EOT.join(docs)
    megabytes = len(text.encode("utf-8")) / 1e6
    calls = {"llmu": timed(lambda: train_bpe(text, vocab_size, [EOT])[1]),
             "tokenizers": timed(lambda: tokenizers_train_bpe(docs, vocab_size))}
    paired = interleave(calls, repeats, warmup=0, base="tokenizers", figure="seconds")
    agree = agreement(paired.outputs["llmu"][-1], paired.outputs["tokenizers"][-1], compare)
    return paired, agree, megabytes


def _run(size: dict, device) -> list[dict]:
    try:
        import tokenizers  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"the bpe_train benchmark compares with the tokenizers library: {exc}") from exc
    paired, agree, megabytes = compare_training(size["mb"], size["vocab"], size.get("repeats", 3),
                                                size.get("compare", 500))
    rows = []
    for name, kind, label in (("llmu", "torch", "llmu train_bpe (Python, incremental)"),
                              ("tokenizers", "external", "tokenizers BpeTrainer (Rust)")):
        fields = paired.row_fields(name, "seconds", rate=False)
        # the ratio fields compare seconds (above 1: slower than tokenizers); speedup is its inverse
        fields["speedup"] = 1.0 / fields["ratio"] if fields["ratio"] else 1.0
        rows.append(dict(provider=name, label=label, kind=kind, **fields, **agree, megabytes=megabytes,
                         mb_per_s=megabytes / paired.stats(name, "seconds")["median"], vocab=size["vocab"]))
    return rows


BPE_TRAIN = register(
    Entry(
        name="bpe_train",
        module=MODULE,
        description="byte-level BPE training on llmu's shipped texts repeated to `mb` MB, to `vocab` tokens: "
                    "llmu's incremental Python trainer vs tokenizers' BpeTrainer (seconds; merge agreement)",
        run=_run,
        gpu_sizes=[{"mb": mb, "vocab": 4096, "repeats": 3} for mb in (1, 3)],
        cpu_sizes=[{"mb": 0.25, "vocab": 2048, "repeats": 2}],
        x_axis="mb",
    )
)
