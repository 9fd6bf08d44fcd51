"""Texts shipped with llmu, for measurements that need real English (perplexity, module 07).

>>> from llmu.data import text, names
>>> names()
['essays', 'luke_kjv']
>>> text("essays")[:17]
'Six Short Essays\\n'

``essays``: six short expository essays (salt, river deltas, suspension bridges, bread,
longitude, honeybee swarms), about 4,300 words, written for this repository and shipped under
its licence (see ``README.md`` in this folder). Being new, they cannot have been part of the
training data of any model the course uses.

``luke_kjv``: the Gospel of Luke in the King James Version (1611), about 26,000 words and 32,000
SmolLM2 tokens, one paragraph per chapter. Its copyright expired long ago: it is in the public
domain, a text anyone may ship. Module 10 measures quantized models' perplexity on it. A text
this old and this widely copied was surely in the model's training data, so its perplexity is
low; what the course reads from it are *differences* between versions of the same model.

``json(name)`` reads the precomputed results shipped next to the texts (``gqa_perplexity`` from
``python -m llmu.gqa.precompute``, ``quant_perplexity`` from ``benchmarks/quant_perplexity.py``,
``spec_acceptance`` from ``benchmarks/spec_acceptance.py``).

``json("sft_examples")`` and ``json("preference_pairs")`` are module 04's small instruction and
preference sets, written for this repository. :func:`byte_tokens` turns a text into the token ids
of a byte-level model, which the course's small training runs use.
"""

from __future__ import annotations

import json as _json
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["text", "names", "json", "json_names", "byte_tokens"]


def _folder():
    return resources.files(__name__)


def names() -> list[str]:
    """The names :func:`text` accepts."""
    return sorted(p.name[:-4] for p in _folder().iterdir() if p.name.endswith(".txt"))


def text(name: str = "essays") -> str:
    """The shipped text ``name`` (see :func:`names`) as one string."""
    if name not in names():
        raise ValueError(f"no text named {name!r}; available: {names()}")
    return (_folder() / f"{name}.txt").read_text(encoding="utf-8")


def byte_tokens(text: str) -> torch.Tensor:
    """The UTF-8 bytes of ``text`` as an int64 tensor: the token ids of a byte-level model
    (vocabulary 256), which the course's small training runs use to skip a tokenizer."""
    import torch

    if not isinstance(text, str) or not text:
        raise ValueError("text must be a non-empty str")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def json_names() -> list[str]:
    """The names :func:`json` accepts."""
    return sorted(p.name[:-5] for p in _folder().iterdir() if p.name.endswith(".json") and p.is_file())


def json(name: str):
    """The shipped JSON file ``name`` (without ``.json``; see :func:`json_names`), parsed."""
    if name not in json_names():
        raise ValueError(f"no JSON file named {name!r}; available: {json_names()}")
    return _json.loads((_folder() / f"{name}.json").read_text(encoding="utf-8"))
