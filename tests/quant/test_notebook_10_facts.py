"""The figures and cross-references notebook 10's prose states, recomputed from the shipped
perplexity table and the course's notebooks (no model is loaded): each test computes a figure and
checks that the cell which states it says the same.
"""

from __future__ import annotations

import json

import pytest

from llmu import course
from llmu.data import json as shipped_json

SOLUTIONS = course.repo_root() / "solutions"
NOTEBOOK = SOLUTIONS / "10_quantization" / "10_quantization.ipynb"


@pytest.fixture(scope="module")
def cells():
    return course.cells_by_grade_id(NOTEBOOK)


def prose(cells, grade_id):
    """A cell's text with its line breaks and indentation folded into single spaces."""
    return " ".join(cells[grade_id].split())


def first_module(cell_type, predicate):
    """The number of the first module (course order) with a cell of ``cell_type`` that satisfies
    ``predicate`` (called with the cell's text)."""
    for path in sorted(SOLUTIONS.glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        if any(c["cell_type"] == cell_type and predicate("".join(c["source"])) for c in cells):
            return path.name[:2]
    raise AssertionError("no module has such a cell")


def rows(bits, group_size=None):
    record = shipped_json("quant_perplexity")
    return [r for r in record["rows"] if r["bits"] == bits and group_size in (None, r["group_size"])]


def test_attention_sink_cross_reference(cells):
    module = first_module("markdown", lambda s: "attention sink" in s.lower())
    assert module == "02"
    assert f"(module {module}'s *attention sink*)" in prose(cells, "outliers_read")


def test_perplexity_cross_reference(cells):
    module = first_module("code", lambda s: "from llmu.models.perplexity import" in s or "perplexity(" in s)
    assert module == "07"
    assert f"**perplexity** (module {module})" in prose(cells, "ppl_md")


def test_two_bit_perplexities(cells):
    ppl = [r["perplexity"] for r in rows(2)]
    assert 100 <= min(ppl) < 1000 and max(ppl) >= 1e6
    assert "perplexities from the hundreds to the millions" in prose(cells, "ppl_read")


def test_three_bit_methods_against_the_reference(cells):
    ref = shipped_json("quant_perplexity")["fp32"]["perplexity"]
    ratios = [r["perplexity"] / ref for r in rows(3, 64) if r["scheme"] in ("gptq", "awq")]
    assert len(ratios) == 2 and all(2 < x < 3 for x in ratios)
    assert "Both still leave the model more than twice as perplexed as the reference" in prose(cells, "ppl_read")


def test_bytes_of_the_scales_by_group_size(cells):
    mb = {r["group_size"]: r["nbytes"] / 1e6 for r in rows(3) if r["scheme"] == "rtn"}
    text = prose(cells, "ppl_read")
    assert (f"for {mb[64] - mb[192]:.1f} MB and then {mb[32] - mb[64]:.1f} MB more of scales and zeros "
            f"({mb[192]:.0f}, {mb[64]:.0f} and {mb[32]:.0f} MB)") in text              # 4.4 and 6.6
