"""What ``benchmarks/gpu.sh`` writes into its summary about a step's outcome.

    python benchmarks/gpu_report.py tests NAME LOG RC LIMIT FAILURES
    python benchmarks/gpu_report.py bench RESULT RC FAILURES [NAME ...]

``tests`` reads the output of ``pytest -v`` (plain or with pytest-xdist) in LOG, which the step
ran with exit status RC under a time slice of LIMIT seconds. It prints one line of counts, and
appends to the file FAILURES one line per failed test, per test that errored, per collection
error, and one for a time slice that ran out (saying how many tests had passed by then). The log
is read rather than the JUnit XML because a run stopped by its time slice may not write the XML.

``bench`` reads the results JSON that ``llmu bench --strict --out RESULT`` wrote (or notes that it
wrote none) and appends one line per problem :func:`llmu.bench.cli.strict_problems` finds: a bench
module that did not import, a row with status ``error``, sizes the ``--budget`` left unmeasured,
a run interrupted by the step's timeout (naming the entries it never reached among NAMEs). Skipped
rows are not failures; the printed counts say how many there were and why.

Exit status 0 whether or not there were failures (they are in FAILURES); anything else means
this script itself failed, which ``gpu.sh`` reports as a failure too.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_ST = "|".join(STATUSES)
# `pytest -v`: "tests/a.py::test_x[p 1] PASSED   [ 20%]"; with xdist: "[gw0] [ 20%] PASSED tests/a.py::test_x[p 1]".
# (A test file outside the rootdir gets an id that starts with "::".)
_PLAIN = re.compile(rf"^(?!\[gw\d)(?P<id>\S[^\n]*?) (?P<st>{_ST})(?: |$)")
_XDIST = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] (?P<st>{_ST}) (?P<id>[^\n]*?::[^\n]*?)\s*$")
# The short test summary (-ra): "FAILED tests/a.py::test_x - AssertionError: ..." and
# "ERROR tests/a.py" for a file that did not collect.
_SHORT = re.compile(r"^(?P<st>FAILED|ERROR) (?P<id>\S[^\n]*?)(?: - (?P<msg>.*))?$")
_SELECTED = re.compile(r"collected (\d+) items?(?: / (\d+) deselected)?(?: / (\d+) selected)?")
_WORKERS = re.compile(r"^\d+ workers? \[(\d+) items?\]")
TIMEOUT_CODES = (124, 137)


def parse_pytest_log(text: str) -> dict:
    """Outcomes in a ``pytest -v`` log: ``selected`` (None when not printed), ``outcome`` (node id
    -> the worst status seen: a test that passed and then errored in teardown counts as an error),
    ``messages`` (node id -> the short summary's message), ``collection_errors`` (paths) and
    ``running`` (tests that started and have no outcome: those a stopped run was in)."""
    selected = None
    outcome: dict[str, str] = {}
    messages: dict[str, str] = {}
    collection_errors: list[str] = []
    started: list[str] = []
    rank = {"PASSED": 0, "XFAIL": 0, "SKIPPED": 0, "XPASS": 1, "FAILED": 2, "ERROR": 2}
    for line in text.splitlines():
        line = line.rstrip()
        m = _SELECTED.search(line)
        if m and line.startswith("collect"):
            total, _, chosen = m.groups()
            selected = int(chosen if chosen is not None else total)
            continue
        m = _WORKERS.match(line)
        if m:
            selected = int(m.group(1))
            continue
        m = _SHORT.match(line)
        if m:
            node, msg = m.group("id").strip(), m.group("msg")
            if "::" in node:
                messages[node] = (msg or "").strip()
            elif m.group("st") == "ERROR":
                collection_errors.append(node)
            continue
        m = _XDIST.match(line) or _PLAIN.match(line)
        if m and "::" in m.group("id"):
            node, status = m.group("id").strip(), m.group("st")
            if node not in outcome or rank[status] >= rank[outcome[node]]:
                outcome[node] = status
        elif "::" in line and not line.startswith((" ", "[gw")):
            started.append(line.strip())  # a test starting (the line -v prints before its outcome)
    running = [node for node in dict.fromkeys(started) if node not in outcome]
    return {"selected": selected, "outcome": outcome, "messages": messages,
            "collection_errors": collection_errors, "running": running}


def tests_report(name: str, log_text: str, rc: int, limit: int) -> tuple[str, list[str]]:
    """(the summary's line of counts, the failure lines) for one pytest step."""
    parsed = parse_pytest_log(log_text)
    counts = Counter(parsed["outcome"].values())
    passed, skipped = counts["PASSED"] + counts["XFAIL"], counts["SKIPPED"]
    bad = [(node, st) for node, st in parsed["outcome"].items() if st in ("FAILED", "ERROR", "XPASS")]
    selected = parsed["selected"]
    ran = sum(counts.values())
    of = f" of {selected} selected" if selected is not None else ""
    line = (f"{name}: {passed} passed, {len(bad)} failed, {skipped} skipped{of}")
    failures = []
    for node, status in bad:
        msg = parsed["messages"].get(node, "")
        word = {"ERROR": "ERROR", "XPASS": "XPASS (strict xfail passed)"}.get(status, "FAILED")
        failures.append(f"{word} {node}" + (f" - {msg}" if msg else "") + f"  [{name}]")
    for path in parsed["collection_errors"]:
        failures.append(f"ERROR collecting {path}  [{name}]")
    if rc in TIMEOUT_CODES:
        left = f", {selected - ran} not run" if selected is not None else ""
        running = parsed["running"]
        stuck = (f"; running then: {', '.join(running[:5])}" + (" ..." if len(running) > 5 else "")
                 if running else "")
        failures.append(f"{name}: its {limit}s time slice ran out: {passed} passed, {len(bad)} failed, "
                        f"{skipped} skipped{of} before it{left}{stuck}")
        line += f"; TIME SLICE OF {limit}s RAN OUT{left}"
    elif rc == 5 or (rc == 0 and selected == 0):
        line = f"{name}: no test selected"
    elif rc != 0 and not failures:
        failures.append(f"{name}: pytest exited {rc} without naming a failed test (see its log)")
    elif rc == 0 and selected is not None and ran != selected:
        failures.append(f"{name}: the log shows the outcome of {ran} tests of {selected} selected (see its log)")
    return line, failures


def bench_report(result: Path | None, rc: int, expected: list[str]) -> tuple[str, list[str]]:
    """(the summary's line of counts, the failure lines) for the ``llmu bench`` step."""
    from llmu.bench.cli import BUDGET_REASON_PREFIX, strict_problems

    if result is None or not result.is_file():
        from llmu.bench.registry import LOAD_ERRORS, load_all

        load_all(strict=False)
        failures = [f"bench: {p}" for p in strict_problems(None, dict(LOAD_ERRORS))]
        failures.append(f"bench: exited {rc} and wrote no results file")
        return "bench: no results", failures
    data = json.loads(result.read_text())
    rows = data.get("rows", [])
    counts = Counter(r.get("status") for r in rows)
    line = (f"bench: {len(rows)} rows: {counts['ok']} measured, {counts['skipped']} skipped, "
            f"{counts['error']} failed; {len(data.get('load_errors') or {})} bench module(s) did not import")
    skipped: dict[str, list[str]] = {}  # reason -> entries, in run order
    for r in rows:
        if r.get("status") == "skipped" and not str(r.get("reason")).startswith(BUDGET_REASON_PREFIX):
            entries = skipped.setdefault(str(r.get("reason")), [])
            if r.get("entry") not in entries:
                entries.append(r.get("entry"))
    for reason, entries in skipped.items():
        line += f"\n  skipped ({', '.join(map(str, entries))}): {reason}"
    if data.get("interrupted") and not expected:
        from llmu.bench.registry import load_all

        expected = list(load_all(strict=False))
    failures = [f"bench: {p}" for p in strict_problems(data, expected=expected)]
    if rc in TIMEOUT_CODES and not data.get("interrupted"):
        failures.append(f"bench: stopped by its time limit (exit {rc})")
    elif rc not in (0, 1, 130, *TIMEOUT_CODES):
        failures.append(f"bench: exited {rc}")
    elif rc != 0 and not failures:
        failures.append(f"bench: exited {rc} without a named problem (see its log)")
    return line, failures


def main(argv: list[str]) -> int:
    if len(argv) >= 6 and argv[0] == "tests":
        name, log, rc, limit, failures_file = argv[1], Path(argv[2]), int(argv[3]), int(argv[4]), argv[5]
        text = log.read_text(errors="replace") if log.is_file() else ""
        line, failures = tests_report(name, text, rc, limit)
    elif len(argv) >= 4 and argv[0] == "bench":
        result = Path(argv[1]) if argv[1] else None
        rc, failures_file, expected = int(argv[2]), argv[3], argv[4:]
        line, failures = bench_report(result, rc, expected)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print(line)
    if failures:
        with open(failures_file, "a") as f:
            f.writelines(x + "\n" for x in failures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
