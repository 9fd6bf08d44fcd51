"""The acceptance table of module 11: the script that measures it (``benchmarks/spec_acceptance.py``),
the copy shipped in ``llmu/data/spec_acceptance.json`` and its reader (``llmu.spec.table``).

The script runs on a tiny grid (the edit prompt, 6 new tokens, prompt lookup and an early exit,
greedy and temperature 1; about ten seconds): it writes its rows, ``--resume`` adds the missing
ones and keeps the others, and resuming a file made with other settings is refused. The shipped
table is checked for what the notebook relies on: the whole grid, every greedy row identical to
plain greedy decoding, acceptance and tokens per step equal to their counts' ratios, and prompt
lookup accepting more on the edit prompt (which copies its input) than on the story. One greedy
row is decoded again live and must give the shipped counts exactly.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from llmu import course
from llmu.spec.table import acceptance_record, load_acceptance_table

SCRIPT = course.repo_root() / "benchmarks" / "spec_acceptance.py"


def _script():
    spec = importlib.util.spec_from_file_location("spec_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_order():
    plan = _script().plan(["edit", "story"], ["ngram", "exit4"], [1, 2, 4], [1], [0.0, 1.0])
    assert plan[:3] == [(0.0, "edit", "ngram", [1, 2, 4]), (0.0, "edit", "exit4", [1]),
                        (0.0, "story", "ngram", [1, 2, 4])]
    assert len(plan) == 8 and plan[-1] == (1.0, "story", "exit4", [1])


def _check_row_arithmetic(r):
    if r["proposed"]:
        assert r["acceptance"] == pytest.approx(r["accepted"] / r["proposed"])
        assert 0 <= r["acceptance"] <= 1
    else:
        assert r["acceptance"] is None
    assert r["tokens_per_step"] == pytest.approx(r["emitted"] / r["steps"])
    assert 1 <= r["tokens_per_step"] <= r["gamma"] + 1 and r["accepted"] <= r["proposed"] <= r["gamma"] * r["steps"]
    assert r["speedup"] == pytest.approx((r["emitted"] / r["seconds"]) / (r["plain_tokens"] / r["plain_seconds"]),
                                         rel=1e-3)  # seconds are rounded to 0.1 ms
    assert r["speedup"] > 0 and 0 <= r["draft_s"] <= r["seconds"] and r["target_s"] <= r["seconds"]
    if r["temperature"] == 0:
        assert r["identical"] is True and r["emitted"] == r["plain_tokens"]
    else:
        assert r["identical"] is None


@pytest.mark.slow  # loads SmolLM2
def test_script_small_run_and_resume(tmp_path, smollm2):
    out = tmp_path / "table.json"
    common = ["--out", str(out), "--prompts", "edit", "--drafts", "ngram", "exit4", "--exit-gammas", "1",
              "--temperatures", "0", "1", "--new", "6", "--threads", "1"]
    script = _script()
    threads = torch.get_num_threads()
    try:
        script.main([*common, "--gammas", "2"])
        record = json.loads(out.read_text())
        keys = [(r["temperature"], r["draft"], r["gamma"]) for r in record["rows"]]
        assert keys == [(0.0, "ngram", 2), (0.0, "exit4", 1), (1.0, "ngram", 2), (1.0, "exit4", 1)]
        assert record["max_new_tokens"] == 6 and record["threads"] == 1 and record["torch"] == torch.__version__
        assert record["grid"]["gammas"] == {"ngram": [2], "exit4": [1]}
        for r in record["rows"]:
            assert r["prompt"] == "edit" and r["emitted"] <= 6
            _check_row_arithmetic(r)
        script.main([*common, "--gammas", "2", "4", "--resume"])
        again = json.loads(out.read_text())
        assert again["rows"][:4] == record["rows"]
        assert [(r["temperature"], r["draft"], r["gamma"]) for r in again["rows"][4:]] == [(0.0, "ngram", 4),
                                                                                          (1.0, "ngram", 4)]
        rows = load_acceptance_table(draft="ngram", temperature=0, record=again)
        assert [r["gamma"] for r in rows] == [2, 4]
        with pytest.raises(SystemExit, match="other settings"):
            script.main([*common, "--gammas", "2", "--resume", "--new", "5"])
    finally:
        torch.set_num_threads(threads)


def test_shipped_table_has_the_whole_grid():
    script, record = _script(), acceptance_record()
    assert record["model"] == script.MODEL and record["max_new_tokens"] == 96 and record["threads"] == 1
    assert {"date", "torch", "environment", "seed", "eos_token_id", "grid", "run_seconds"} <= set(record)
    rows = {script.row_key(r): r for r in record["rows"]}
    assert len(rows) == len(record["rows"])  # one row per key
    for temperature, prompt, draft, gammas in script.plan(script.PROMPTS, script.DRAFTS, script.GAMMAS,
                                                          script.EXIT_GAMMAS, script.TEMPERATURES):
        for gamma in gammas:
            assert (prompt, draft, gamma, temperature) in rows, f"missing: {prompt} {draft} {gamma} {temperature}"
    for r in record["rows"]:
        _check_row_arithmetic(r)


def test_shipped_table_says_what_the_module_says():
    for gamma in _script().GAMMAS:
        (edit,) = load_acceptance_table(prompt="edit", draft="ngram", temperature=0, gamma=gamma)
        (story,) = load_acceptance_table(prompt="story", draft="ngram", temperature=0, gamma=gamma)
        assert edit["acceptance"] > story["acceptance"] + 0.3
        assert edit["tokens_per_step"] > story["tokens_per_step"]
    # at a large gamma prompt lookup on the edit prompt is clearly faster than plain decoding
    assert max(r["speedup"] for r in load_acceptance_table(prompt="edit", draft="ngram", temperature=0)) > 1.5


@pytest.mark.slow  # loads SmolLM2
def test_a_greedy_row_recomputes_live(smollm2):
    """A greedy row, decoded again as the script decodes it (its ``generate``: the same model,
    prompt, draft, gamma, token budget and end token), gives the shipped counts exactly. Greedy
    decoding takes the argmax of the target's logits and prompt lookup proposes by matching
    tokens, so nothing here is random: a count that differs means the table no longer describes
    this model and this code (or two logits tied within float32 rounding somewhere in 76 tokens,
    which a different machine could break the other way; then the table must be remade). The
    row is prompt lookup on the edit prompt at gamma 4: 21 steps of the target, a few seconds."""
    from llmu.models.sampling import SamplingParams
    from llmu.spec.bench import make_draft
    from llmu.spec.decode import speculative_generate
    from llmu.spec.prompts import end_token, prompt_ids

    model, tokenizer = smollm2
    record = acceptance_record()
    (want,) = load_acceptance_table(prompt="edit", draft="ngram", temperature=0, gamma=4)
    draft = make_draft(model, "ngram")
    assert want["draft_label"] == draft.name
    threads = torch.get_num_threads()
    torch.set_num_threads(record["threads"])
    try:
        out = speculative_generate(model, draft, prompt_ids(tokenizer, "edit"), record["max_new_tokens"],
                                   gamma=4, params=SamplingParams(temperature=0.0, seed=record["seed"]),
                                   eos_token_id=record["eos_token_id"])
    finally:
        torch.set_num_threads(threads)
    assert record["eos_token_id"] == end_token(tokenizer)
    s = out.stats
    got = dict(accepted=sum(s.accepted), proposed=sum(s.proposed), steps=s.steps, emitted=len(out.tokens),
               ended=bool(out.tokens) and out.tokens[-1] == record["eos_token_id"])
    assert got == {key: want[key] for key in got}
    assert got["accepted"] / got["proposed"] == want["acceptance"]


def test_reader_filters_and_refuses_unknown_values():
    everything = load_acceptance_table()
    assert everything == acceptance_record()["rows"]
    rows = load_acceptance_table(prompt="summarise", temperature=0.7)
    assert rows and all(r["prompt"] == "summarise" and r["temperature"] == 0.7 for r in rows)
    assert {r["draft"] for r in rows} == {"ngram", "exit4", "exit8", "exit15"}
    rows[0]["acceptance"] = -1  # copies: the next call is unaffected
    assert load_acceptance_table(prompt="summarise", temperature=0.7)[0]["acceptance"] != -1
    with pytest.raises(ValueError, match="no draft 'medusa'"):
        load_acceptance_table(draft="medusa")
    with pytest.raises(ValueError, match="no temperature"):
        load_acceptance_table(temperature=0.5)
