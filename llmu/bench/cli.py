"""``llmu bench`` and ``python -m llmu.bench``: list, run and record the benchmark entries."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from llmu.bench.paired import format_ratio
from llmu.bench.registry import LOAD_ERRORS, REGISTRY, load_all
from llmu.bench.runner import TRITON_ON_CPU

# (header, width, right-aligned) of the printed table.
_COLUMNS = [
    ("entry", 22, False), ("provider", 32, False), ("size", 34, False), ("dtype", 9, False),
    ("ms", 10, True), ("p20..p80 ms", 21, True), ("TFLOP/s", 9, True), ("GB/s", 9, True),
    ("peak", 9, True), ("", 0, False),
]


def _num(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.{digits}g}"


def _cells(row: dict) -> list[str]:
    if row.get("status") == "ok" and row.get("ms") is not None:
        spread = (f"{_num(row.get('ms_p20'), 3)}..{_num(row.get('ms_p80'), 3)}"
                  if row.get("ms_p20") is not None else "")
        fracs = [(row.get("frac_flops"), "fl"), (row.get("frac_bw"), "bw")]
        fracs = [(f, tag) for f, tag in fracs if f is not None]
        peak = ""
        if fracs:
            f, tag = max(fracs)
            peak = f"{100 * f:.0f}% {tag}"
        timing = [_num(row["ms"]), spread, _num(row.get("tflops"), 3), _num(row.get("gbs"), 4), peak]
        # whole-model entries: ms is per token, and a paired ratio says how they compare
        notes = [f"{row['tokens_per_s']:.1f} tokens/s"] if row.get("tokens_per_s") is not None else []
        notes += [ratio_note(row), row.get("reason") or ""]
        note = "; ".join(n for n in notes if n)
    else:
        timing = ["", "", "", "", ""]
        reason = row.get("reason") or ""
        if reason == TRITON_ON_CPU:
            reason = "Triton kernels are timed on a GPU only (interpreter here)"
        note = f"{row.get('status', '?')}: {reason}"
    # A label says more than the provider name when one provider gives several rows per size
    # ("llmu prefill", "llmu decode").
    provider = row.get("label") or row.get("provider") or "-"
    if row.get("kind"):
        provider = f"{provider} [{row['kind']}]"
    return [row.get("entry") or "", provider, row.get("size_label") or "", row.get("dtype") or "",
            *timing, note]


def ratio_note(row: dict) -> str:
    """The paired ratio of a whole-model row (:mod:`llmu.bench.paired`) as the table prints it:
    ``"x1.85 (1.62..2.10) over transformers"`` (median of the per-round ratios, their min..max),
    with ``", not distinguishable from 1"`` when that range includes 1, ``"base of the ratios"`` on
    the base's own row, the number of rounds and the load average at start and end; ``""`` for a
    row without them."""
    parts = []
    if row.get("ratio_to") is not None and row.get("ratio_to") == row.get("provider"):
        parts.append("base of the ratios")
    elif row.get("ratio") is not None:
        text = f"x{format_ratio(row['ratio'])}"
        if row.get("ratio_min") is not None and row.get("ratio_max") is not None:
            text += f" ({format_ratio(row['ratio_min'])}..{format_ratio(row['ratio_max'])})"
        if row.get("ratio_to"):
            text += f" over {row['ratio_to']}"
        if row.get("ratio_overlaps_1"):
            text += ", not distinguishable from 1"
        parts.append(text)
    if row.get("over_modules") is not None:
        parts.append(f"x{format_ratio(row['over_modules'])} ({format_ratio(row['over_modules_min'])}.."
                     f"{format_ratio(row['over_modules_max'])}) over the module path")
    if row.get("roof_fraction") is not None:
        parts.append(f"{row['roof_fraction']:.0%} of the memory roof ({row['roof_tokens_per_s']:.1f} tokens/s at "
                     f"{row['bandwidth_gbs']:.1f} GB/s, {row.get('threads', '?')} threads)")
    if row.get("rounds") is not None:
        parts.append(f"{row['rounds']} rounds")
    start, end = row.get("load_avg_start"), row.get("load_avg_end")
    if start is not None or end is not None:
        parts.append(f"load {_num(start, 2)}->{_num(end, 2)}")
    return "; ".join(parts)


def _line(cells: Sequence[str]) -> str:
    parts = []
    for text, (_, width, right) in zip(cells, _COLUMNS):
        parts.append(text.rjust(width) if right else text.ljust(width))
    return "  ".join(parts).rstrip()


def table_header() -> str:
    head = _line([c[0] for c in _COLUMNS])
    return head + "\n" + "-" * len(head)


def format_row(row: dict) -> str:
    """One result row as a line of the table."""
    return _line(_cells(row))


def format_table(rows: Sequence[dict]) -> str:
    """Result rows as a readable fixed-width table (peak: % of the device's FLOP/s or bandwidth
    peak, whichever is higher)."""
    return "\n".join([table_header(), *(format_row(r) for r in rows)])


def format_list(registry) -> str:
    """The registered entries: name, course module, providers with their kinds, sizes."""
    if not registry:
        return "no benchmark entries are registered"
    table = [("name", "module", "providers", "sizes gpu/cpu", "description")]
    for entry in registry.values():
        providers = ", ".join(f"{name} [{p.kind}]" for name, p in entry.providers.items()) or "run="
        table.append((entry.name, entry.module, providers,
                      f"{len(entry.gpu_sizes)}/{len(entry.cpu_sizes)}", entry.description))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in table]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


#: How the reason starts that llmu.bench.runner.run gives the sizes its budget left unstarted.
BUDGET_REASON_PREFIX = "time budget of "


def strict_problems(results: dict | None, load_errors=None, expected=None) -> list[str]:
    """What makes a run fail under ``--strict``, one line each (empty when nothing did).

    * a bench module that did not import (``results["load_errors"]``, or ``load_errors`` when there
      are no results): its entries were not measured at all;
    * every row with status ``"error"``, named by entry, provider and size, with its reason;
    * the sizes ``--budget`` left unstarted, one line per entry: a benchmark that did not run;
    * a run that was interrupted (``"interrupted"``: a hard timeout or Ctrl-C), with the entries of
      ``expected`` (names) that have no row at all.

    Skipped rows (a Triton kernel on a CPU, a library that is not installed) are not problems.
    """
    problems = []
    errors = (results or {}).get("load_errors") or load_errors or {}
    for module, reason in errors.items():
        problems.append(f"{module} did not import, its entries were not measured: {reason}")
    if results is None:
        return problems
    not_started: dict[str, int] = {}
    for row in results.get("rows", []):
        where = " ".join(x for x in (row.get("entry"), row.get("label") or row.get("provider"),
                                      row.get("size_label")) if x)
        if row.get("status") == "error":
            problems.append(f"{where}: error: {row.get('reason')}")
        elif row.get("status") == "skipped" and str(row.get("reason") or "").startswith(BUDGET_REASON_PREFIX):
            not_started[row.get("entry")] = not_started.get(row.get("entry"), 0) + 1
    for entry, n in not_started.items():
        problems.append(f"{entry}: {n} size(s) not measured, the --budget ran out before them")
    if results.get("interrupted"):
        seen = {row.get("entry") for row in results.get("rows", [])}
        missing = [name for name in (expected or []) if name not in seen]
        problems.append(f"the run was interrupted after {len(results.get('rows', []))} rows"
                        + (f"; never reached: {', '.join(missing)}" if missing else ""))
    return problems


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmu bench",
        description="Time the course's ops: Triton kernels (GPU only), llmu's torch references and "
                    "PyTorch built-ins, as ms, TFLOP/s, GB/s and % of the device's peak.")
    p.add_argument("names", nargs="*", metavar="NAME", help="entries to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the registered entries and exit")
    p.add_argument("--out", metavar="FILE", help="write the results as JSON to FILE")
    p.add_argument("--sizes", choices=["auto", "cpu", "gpu"], default="auto",
                   help="which sizes to run (auto: GPU sizes on CUDA, CPU sizes otherwise)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--repeats", type=int, help="timed samples per measurement on the CPU (default 7)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: as the process has them)")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="stop starting new sizes after this many seconds (they are recorded as skipped)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a bench module did not import, a row failed, or --budget left "
                        "sizes unmeasured (skipped rows are fine); each is named on stderr")
    return p


def _catch_sigterm():
    """Turn SIGTERM into KeyboardInterrupt while benchmarks run; returns the previous handler."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except (ValueError, AttributeError):  # not the main thread, or no SIGTERM on this platform
        return None


def _restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def cli_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``llmu bench``. Returns the exit status: 0 when every measurement that was
    attempted worked, 1 when one failed (with ``--strict``, also when a bench module did not
    import or ``--budget`` left sizes unmeasured: see :func:`strict_problems`), 2 for a bad
    request (such as an unknown name), 130 when interrupted (results so far are still written
    with ``--out``)."""
    try:
        return _main(argv)
    except BrokenPipeError:  # `llmu bench --list | head`: the reader left, which is no error
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 0


def _main(argv: Sequence[str] | None) -> int:
    from llmu.bench.results import save
    from llmu.bench.runner import environment_info, make_results, run

    args = _parser().parse_args(list(argv) if argv is not None else None)
    registry = load_all(strict=False)
    for module, reason in LOAD_ERRORS.items():
        print(f"warning: {module} did not load: {reason}", file=sys.stderr)
    if args.list:
        print(format_list(REGISTRY))
        if args.strict and LOAD_ERRORS:
            _report_strict(strict_problems(None, LOAD_ERRORS))
            return 1
        return 0
    unknown = [n for n in args.names if n not in registry]
    if unknown:
        print(f"llmu bench: unknown benchmark name(s) {', '.join(unknown)}; "
              f"known: {', '.join(sorted(registry)) or '(none registered)'}", file=sys.stderr)
        return 2
    if not registry:
        print("llmu bench: no benchmark entries are registered", file=sys.stderr)
        return 2

    done: list[dict] = []

    def progress(row):
        if not done:
            print(table_header())
        done.append(row)
        print(format_row(row), flush=True)

    # A run stopped from outside (Ctrl-C, or `timeout` sending SIGTERM) still saves what it measured.
    previous = _catch_sigterm()
    try:
        results = run(args.names or None, device=args.device, sizes=args.sizes, repeats=args.repeats,
                      progress=progress, budget_s=args.budget, threads=args.threads)
    except KeyboardInterrupt:
        print(f"\ninterrupted after {len(done)} rows", file=sys.stderr)
        if args.out:
            partial = make_results(done, environment_info(args.device), args.sizes,
                                   dict(LOAD_ERRORS), interrupted=True)
            print(f"wrote {save(partial, args.out)} (partial)")
        return 130
    finally:
        _restore_sigterm(previous)
    env = results["environment"]
    where = env.get("gpu_name") or f"CPU {env.get('device_name')}, {env.get('threads')} threads"
    counts = {s: sum(r["status"] == s for r in results["rows"]) for s in ("ok", "skipped", "error")}
    print(f"\n{where}; torch {env.get('torch')}, triton {env.get('triton')} ({env.get('triton_mode')}); "
          f"{counts['ok']} measured, {counts['skipped']} skipped, {counts['error']} failed")
    if args.out:
        print(f"wrote {save(results, args.out)}")
    if args.strict:
        problems = strict_problems(results)
        _report_strict(problems)
        if problems:
            return 1
    return 1 if counts["error"] else 0


def _report_strict(problems: Sequence[str]) -> None:
    for line in problems:
        print(f"strict: {line}", file=sys.stderr)
