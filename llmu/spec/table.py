"""The measured acceptance table of module 11, shipped as ``llmu/data/spec_acceptance.json``.

``benchmarks/spec_acceptance.py`` decodes SmolLM2-135M-Instruct on each prompt of
:mod:`llmu.spec.prompts` with each draft (``"ngram"``: prompt lookup; ``"exit4"``, ``"exit8"``,
``"exit15"``: early exit after that many of 30 blocks), several ``gamma`` and temperatures 0,
0.7 and 1 (18 minutes on one CPU thread, hence the shipped copy). Each row holds
``prompt``, ``draft``, ``gamma``, ``temperature``, the counts ``accepted``, ``proposed``,
``steps`` and ``emitted``, ``acceptance`` (``accepted / proposed``), ``tokens_per_step``
(``emitted / steps``), the seconds of the generation and of plain decoding run right before it,
``speedup`` (tokens/s over plain decoding's) and, for greedy rows, ``identical`` (always true:
the same tokens as plain greedy decoding).

>>> rows = load_acceptance_table(prompt="edit", draft="ngram", temperature=0)   # doctest: +SKIP
>>> [(r["gamma"], round(r["acceptance"], 2), round(r["tokens_per_step"], 2)) for r in rows]  # doctest: +SKIP

The notebook plots each row's ``tokens_per_step`` against its ``acceptance`` on the curve
``llmu.spec.decode.expected_tokens_per_step(a, gamma) = (1 - a^(gamma+1)) / (1 - a)``.
"""

from __future__ import annotations

__all__ = ["TABLE", "acceptance_record", "load_acceptance_table"]

#: The name of the shipped file in ``llmu/data`` (without ``.json``).
TABLE = "spec_acceptance"


def acceptance_record() -> dict:
    """The whole shipped file: its settings (``model``, ``max_new_tokens``, ``seed``, ``threads``,
    ``date``, ``torch``, the ``grid``) and its ``rows``."""
    from llmu.data import json

    return json(TABLE)


def load_acceptance_table(prompt: str | None = None, draft: str | None = None, temperature: float | None = None,
                          gamma: int | None = None, *, record: dict | None = None) -> list[dict]:
    """The rows of the shipped table (or of ``record``, a file the script wrote), as plain dicts
    (copies), in the file's order, keeping those that match every argument given: ``prompt``
    (``"edit"``, ``"summarise"``, ``"story"``), ``draft`` (``"ngram"``, ``"exit4"``, ...),
    ``temperature`` (0, 0.7, 1.0) and ``gamma``. A value the table does not hold raises
    ``ValueError`` naming the ones it does."""
    record = acceptance_record() if record is None else record
    rows = record["rows"]
    wanted = dict(prompt=prompt, draft=draft, temperature=temperature, gamma=gamma)
    for key, value in wanted.items():
        if value is None:
            continue
        held = sorted({r[key] for r in rows})
        if not any(_same(r[key], value) for r in rows):
            raise ValueError(f"the table has no {key} {value!r}; it has {held}")
    return [dict(r) for r in rows
            if all(value is None or _same(r[key], value) for key, value in wanted.items())]


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return abs(float(a) - float(b)) < 1e-9
    return a == b
