"""llmu.bench.paired: calls in turn, paired ratios and their spread, outputs compared, bad input refused;
and the printed table showing a row's ratio. Fake calls only: no model, no timing asserted."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llmu import bench
from llmu.bench import paired as paired_mod
from llmu.bench.cli import format_table, ratio_note
from llmu.bench.paired import first_difference, interleave, timed
from llmu.bench.registry import Entry


def scripted(log: list, name: str, values, output=None):
    """A call that appends ``name`` to ``log`` and returns the next of ``values`` (after warm-ups)."""
    it = iter(values)

    def call():
        log.append(name)
        v = next(it)
        return v if output is None else {"value": v, "output": output}

    return call


def test_calls_are_made_in_turn_after_the_warm_up():
    log = []
    p = interleave({"A": scripted(log, "A", [0, 0, 1, 2, 3]), "B": scripted(log, "B", [0, 0, 1, 1, 1])},
                   repeats=3, warmup=2)
    assert log == ["A", "B"] * 5                     # two warm-up rounds, then three timed ones
    assert p.order == ["A", "B", "A", "B", "A", "B"]  # the timed calls only
    assert p.samples == {"A": {"value": [1.0, 2.0, 3.0]}, "B": {"value": [1.0, 1.0, 1.0]}}
    assert p.rounds == 3 and p.warmup == 2 and p.base == "B" and p.figure == "value"


def test_medians_and_paired_ratios():
    # A is twice B in every round while the machine's load makes both swing: the paired ratio is
    # exactly 2 with no spread, where comparing A's and B's ranges would overlap.
    log = []
    a, b = [20.0, 8.0, 40.0, 10.0, 30.0], [10.0, 4.0, 20.0, 5.0, 15.0]
    p = interleave({"A": scripted(log, "A", a), "B": scripted(log, "B", b)}, repeats=5, warmup=0)
    assert p.stats("A") == {"median": 20.0, "min": 8.0, "max": 40.0, "p20": pytest.approx(9.6),
                            "p80": pytest.approx(32.0), "n": 5}
    assert p.ratios("A") == [2.0] * 5
    r = p.ratio("A")
    assert (r["median"], r["min"], r["max"], r["overlaps_1"]) == (2.0, 2.0, 2.0, False)
    assert p.ratio("B") is None                                  # the base has no ratio over itself
    text = p.report()
    assert "x2.00 (2.00..2.00)" in text and "(base of the ratios)" in text and "not distinguishable" not in text


def test_ratios_over_another_provider_than_the_base():
    log = []
    p = interleave({"A": scripted(log, "A", [6.0, 3.0]), "B": scripted(log, "B", [3.0, 1.0]),
                    "C": scripted(log, "C", [1.0, 1.0])}, repeats=2, warmup=0, base="C")
    assert p.ratios("A") == [6.0, 3.0] and p.ratios("A", over="B") == [2.0, 3.0]
    assert p.ratio("A", over="B")["median"] == 2.5 and p.ratio("B", over="B") is None
    with pytest.raises(ValueError, match="over='D' is not one of the providers"):
        p.ratios("A", over="D")


def test_the_overlap_flag():
    log = []
    p = interleave({"A": scripted(log, "A", [1.1, 0.9, 1.05]), "B": scripted(log, "B", [1.0, 1.0, 1.0])},
                   repeats=3, warmup=0)
    assert p.ratio("A")["overlaps_1"] is True and "not distinguishable from 1" in p.report()
    one = interleave({"A": scripted(log, "A", [3.0]), "B": scripted(log, "B", [1.0])}, repeats=1, warmup=0)
    assert one.ratio("A")["overlaps_1"] is True, "one round has no spread: not distinguishable"
    clear = interleave({"A": scripted(log, "A", [1.2, 1.3]), "B": scripted(log, "B", [1.0, 1.0])}, repeats=2,
                       warmup=0)
    assert clear.ratio("A")["overlaps_1"] is False


def test_dict_figures_base_and_reference():
    calls = {name: (lambda k=k: {"tps": 10.0 * k, "other": 1.0, "info": {"k": k}, "output": [1, 2, 3]})
             for k, name in enumerate(("x", "y", "z"), start=1)}
    p = interleave(calls, repeats=2, warmup=0, base="x", check=True)
    assert p.figure == "tps" and p.reference == "x" and p.mismatches == {}
    assert p.ratio("z")["median"] == 3.0 and p.ratio("z", "other")["median"] == 1.0
    assert p.info["y"] == [{"k": 2}, {"k": 2}] and p.outputs["z"][0] == [1, 2, 3]
    no_base = interleave(calls, repeats=1, warmup=0)  # three calls and no base: no ratios
    assert no_base.base is None and no_base.ratio("x") is None
    with pytest.raises(ValueError, match="no base"):
        no_base.ratios("x")


def test_outputs_are_compared_round_by_round():
    rounds = iter([[1, 2, 3], [1, 2, 3], [1, 9, 3]])
    calls = {"ref": lambda: {"v": 1.0, "output": [1, 2, 3]},
             "ok": lambda: {"v": 2.0, "output": [1, 2, 3]},
             "drifts": lambda: {"v": 3.0, "output": next(rounds)}}
    p = interleave(calls, repeats=3, warmup=0, base="ref", check=["ok", "drifts"],
                   compare=lambda want, got: first_difference(want, got, ("token",)))
    assert p.mismatches == {"drifts": "output differs from ref's in round 3: token 1: 9 instead of 2"}
    fields = p.row_fields("drifts")
    assert fields["status"] == "error" and "token 1: 9 instead of 2" in fields["reason"]
    assert "status" not in p.row_fields("ok")
    assert "OUTPUT DIFFERS" in p.report()


def test_first_difference():
    assert first_difference([[1, 2], [3]], [[1, 2], [3]]) is None
    assert first_difference([[1, 2], [3, 4]], [[1, 2], [3, 5]], ("request", "token")) == \
        "request 1, token 1: 5 instead of 4"
    assert first_difference([1, 2, 3], [1, 2], ("token",)) == "2 tokens instead of 3"
    assert first_difference(torch.tensor([1, 2]), [1, 2]) is None
    assert first_difference(5, 6) == "output: 6 instead of 5"


def test_row_fields():
    p = interleave({"fast": lambda: 100.0, "slow": lambda: 50.0}, repeats=3, warmup=0)
    f = p.row_fields("fast", key="tokens_per_s")
    assert f["ms"] == pytest.approx(10.0) and f["tokens_per_s"] == 100.0 and f["n_samples"] == 3
    assert f["ratio"] == f["speedup"] == 2.0 and f["ratio_to"] == "slow" and f["ratio_overlaps_1"] is False
    assert f["rounds"] == 3
    assert set(paired_mod.PAIRED_FIELDS) <= set(f)
    base = p.row_fields("slow")
    assert base["ratio"] is None and base["speedup"] == 1.0 and base["ratio_to"] == "slow"
    assert base["ms"] == pytest.approx(20.0)
    seconds = p.row_fields("fast", rate=False)
    assert seconds["ms"] == pytest.approx(100_000.0)
    json.dumps(f)


def test_load_average_at_start_and_end(monkeypatch):
    loads = iter([(1.5, 1, 1), (2.5, 1, 1)])
    monkeypatch.setattr(paired_mod.os, "getloadavg", lambda: next(loads))
    p = interleave({"A": lambda: 1.0, "B": lambda: 1.0}, repeats=1, warmup=0)
    assert (p.load_avg_start, p.load_avg_end) == (1.5, 2.5)
    assert "load average 1.50 -> 2.50" in p.report()


def test_timed():
    call = timed(lambda: [4, 5])
    got = call()
    assert got["output"] == [4, 5] and got["seconds"] >= 0
    p = interleave({"a": timed(lambda: 1), "b": timed(lambda: 1)}, repeats=2, warmup=1, check=True)
    assert p.figure == "seconds" and p.mismatches == {}
    with pytest.raises(TypeError, match="function"):
        timed(3)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(calls=[lambda: 1.0]), TypeError, "dict of name"),
    (dict(calls={}), ValueError, "empty"),
    (dict(calls={"a": 3}), TypeError, "function of no argument"),
    (dict(calls={1: lambda: 1.0}), TypeError, "names must be str"),
    (dict(repeats=0), ValueError, "repeats must be >= 1"),
    (dict(repeats=2.5), TypeError, "repeats must be an int"),
    (dict(repeats=True), TypeError, "repeats must be an int"),
    (dict(warmup=-1), ValueError, "warmup must be >= 0"),
    (dict(base="c"), ValueError, "base 'c'"),
    (dict(check=["c"]), ValueError, "check names 'c'"),
    (dict(check="a"), TypeError, "check must be"),
    (dict(reference="c"), ValueError, "reference 'c'"),
    (dict(compare=3), TypeError, "compare must be"),
    (dict(figure="nope"), ValueError, "figure 'nope'"),
])
def test_bad_arguments(kwargs, error, match):
    args = dict(calls={"a": lambda: 1.0, "b": lambda: 2.0}, repeats=1, warmup=0)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        interleave(args.pop("calls"), **args)


@pytest.mark.parametrize("returned, error, match", [
    (None, TypeError, "returned NoneType.*timed"),
    ("fast", TypeError, "returned str"),
    (True, TypeError, "returned bool"),
    ({"v": "x"}, TypeError, "figure 'v' is str"),
    ({"v": math.nan}, ValueError, "not a finite number"),
    ({"output": [1]}, ValueError, "no figure"),
])
def test_bad_returns(returned, error, match):
    with pytest.raises(error, match=match):
        interleave({"a": lambda: returned, "b": lambda: 1.0}, repeats=1, warmup=0)


def test_figures_must_stay_the_same_and_outputs_must_exist():
    rounds = iter([{"v": 1.0}, {"w": 1.0}])
    with pytest.raises(ValueError, match="round 2"):
        interleave({"a": lambda: next(rounds), "b": lambda: {"v": 1.0}}, repeats=2, warmup=0)
    with pytest.raises(ValueError, match="no 'output'"):
        interleave({"a": lambda: 1.0, "b": lambda: 1.0}, repeats=1, warmup=0, check=True)
    p = interleave({"a": lambda: 1.0, "b": lambda: 0.0}, repeats=1, warmup=0)
    with pytest.raises(ValueError, match="is 0"):
        p.ratio("a")
    with pytest.raises(ValueError, match="no provider"):
        p.stats("c")


# ---------------------------------------------------------------------------------------------
# The printed table
# ---------------------------------------------------------------------------------------------

def _whole_entry(a_values, b_values, wrong=False):
    """A whole-model entry measured through interleave with scripted calls."""
    def run(size, device):
        log = []
        calls = {"new": scripted(log, "new", a_values, output=[1, 2] if not wrong else [1, 3]),
                 "old": scripted(log, "old", b_values, output=[1, 2])}
        p = interleave(calls, repeats=len(a_values), warmup=0, check=True)
        return [dict(provider=name, label=name, kind="torch", **p.row_fields(name, key="tokens_per_s"))
                for name in p.names]

    return Entry(name="whole_paired", module="99_test", description="tokens/s", run=run, cpu_sizes=[{"n": 1}])


def test_table_shows_the_ratio_its_spread_and_the_flag():
    rows = bench.run(entries=[_whole_entry([20.0, 30.0, 25.0], [10.0, 10.0, 10.0])], device="cpu")["rows"]
    new = rows[0]
    assert new["status"] == "ok" and new["ratio"] == 2.5 and new["ratio_to"] == "old"
    table = format_table(rows).splitlines()
    assert "x2.50 (2.00..3.00) over old; 3 rounds; load" in table[2] and "25.0 tokens/s" in table[2]
    assert "base of the ratios; 3 rounds" in table[3]
    close = bench.run(entries=[_whole_entry([9.0, 11.0, 10.5], [10.0, 10.0, 10.0])], device="cpu")["rows"]
    assert "not distinguishable from 1" in format_table(close).splitlines()[2]
    assert ratio_note({"entry": "gemm", "ms": 1.0}) == ""  # kernel rows: nothing added


def test_table_reports_a_row_whose_output_differs():
    rows = bench.run(entries=[_whole_entry([20.0, 30.0], [10.0, 10.0], wrong=True)], device="cpu")["rows"]
    assert rows[0]["status"] == "error" and rows[1]["status"] == "ok"
    line = format_table(rows).splitlines()[2]
    assert "error: output differs from old's in round 1: item 1: 3 instead of 2" in line
