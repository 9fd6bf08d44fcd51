"""The perplexity table of module 10: the script that computes it (``benchmarks/quant_perplexity.py``)
and the copy shipped in ``llmu/data/quant_perplexity.json`` that the notebook reads.

The script is run on a small configuration (the essays, 8-bit RTN, short windows): it writes the
reference, the live check and one row; ``--resume`` adds a row and keeps the first; resuming a file
made with other settings is refused. The shipped table is checked for what the notebook relies on:
every scheme at 8, 4, 3 and 2 bits in groups of 64, ``recovered`` equal to its definition, model
bytes that shrink with the bit width, and a live check whose numbers the notebook can recompute.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from llmu import course
from llmu.data import json as shipped_json

SCRIPT = course.repo_root() / "benchmarks" / "quant_perplexity.py"


def _script():
    spec = importlib.util.spec_from_file_location("quant_perplexity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_order():
    plan = _script().plan([64, 32], [8, 4, 3, 2], ["awq", "rtn"])
    assert plan[:4] == [("rtn", 3, 64), ("awq", 3, 64), ("rtn", 4, 64), ("awq", 4, 64)]
    assert plan[8:10] == [("rtn", 3, 32), ("rtn", 4, 32)]
    assert len(plan) == 16 and len(set(plan)) == 16 and plan[-1] == ("awq", 8, 32)


@pytest.mark.slow
def test_script_small_run_and_resume(tmp_path, smollm2):
    out = tmp_path / "table.json"
    common = ["--out", str(out), "--eval-text", "essays", "--calib-fraction", "0.9", "--schemes", "rtn",
              "--group-sizes", "64", "--window", "128", "--stride", "96", "--live-tokens", "200", "--threads", "1"]
    script = _script()
    script.main([*common, "--bits", "8"])
    record = json.loads(out.read_text())
    assert [(r["scheme"], r["bits"], r["group_size"]) for r in record["rows"]] == [("rtn", 8, 64)]
    ref, row = record["fp32"]["perplexity"], record["rows"][0]
    assert 1 < ref < 1000 and abs(row["perplexity"] / ref - 1) < 0.05  # 8 bits: close to the reference
    assert row["nbytes"] < record["fp32"]["nbytes"]
    live = record["live_check"]
    assert live["tokens"] == 200 and live["bits"] == 4 and live["perplexity"] > 0 and live["reference"] > 0
    script.main([*common, "--bits", "8", "2", "--resume"])
    again = json.loads(out.read_text())
    assert again["rows"][0] == row and [r["bits"] for r in again["rows"]] == [8, 2]
    assert again["rows"][1]["perplexity"] > row["perplexity"]
    with pytest.raises(SystemExit, match="other settings"):
        script.main([*common, "--bits", "4", "--resume", "--stride", "64"])


def test_shipped_table():
    record = shipped_json("quant_perplexity")
    ref = record["fp32"]["perplexity"]
    rows = {(r["scheme"], r["bits"], r["group_size"]): r for r in record["rows"]}
    for scheme in ("rtn", "gptq", "awq"):
        for bits in (8, 4, 3, 2):
            assert (scheme, bits, 64) in rows, f"the table lacks {scheme} {bits}-bit g64"
    assert record["evaluation"]["tokens"] >= 20000 and record["eval_text"] == "luke_kjv"
    for (scheme, bits, gs), r in rows.items():
        if scheme != "rtn":
            rtn = rows[("rtn", bits, gs)]["perplexity"]
            assert r["recovered"] == pytest.approx((rtn - r["perplexity"]) / (rtn - ref))
        assert r["nbytes"] < record["fp32"]["nbytes"]
        if bits < 8:
            if (scheme, 8, gs) in rows:  # (rows are added in order of interest: 8 bits may come later)
                assert r["nbytes"] < rows[(scheme, 8, gs)]["nbytes"]
            assert r["perplexity"] > ref  # fewer bits than the Q4_1 reference's values cannot be free
    assert set(record["live_check"]) >= {"tokens", "scheme", "bits", "group_size", "reference", "perplexity"}
