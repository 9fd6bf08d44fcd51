"""The compile-only process of ``llmu gpu-compile`` (started by :func:`llmu.gpu_compile.run`).

    LLMU_COMPILE_ONLY=1 CUDA_VISIBLE_DEVICES= python -m llmu.gpu_compile [--targets sm_90,sm_80,sm_75]
                                                                           [-k NAME] [--json FILE] [--quiet]
                                                                           [--record FILE] [--write-record FILE]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import sys
import time
import warnings

import torch

import llmu
from llmu import checks, runtime
from llmu.gpu_compile import TARGET_NAMES, capture, cases as C, cases_more as M
from llmu.gpu_compile.cases import BF16, FLOAT_DTYPES, Case


def all_cases() -> list[Case]:
    """Every case, module by module (``cases`` and ``cases_more``); then those of
    ``LLMU_GPU_COMPILE_CASES`` ("module:function", comma-separated; each function returns a list of
    cases), which is how the tests plant a faulty kernel to see the check fail."""
    cases: list[Case] = []
    for part in (C._welcome, C._embeddings, C._attention, C._layers, C._kvcache, C._flash, C._paged,
                 M._moe, M._quant, M._mamba, M._training, M._spec, M._models):
        cases += part()
    for spec in filter(None, os.environ.get("LLMU_GPU_COMPILE_CASES", "").split(",")):
        module, _, function = spec.strip().partition(":")
        cases += getattr(importlib.import_module(module), function)()
    return cases


def _dtype_name(dt) -> str:
    return str(dt).removeprefix("torch.")


def llmu_kernels() -> dict:
    """Every ``@triton.jit`` function defined at module level in llmu: ``{module:name: JITFunction}``."""
    from triton.runtime.jit import JITFunction

    found = {}
    for info in pkgutil.walk_packages(llmu.__path__, "llmu."):
        if info.name.endswith("__main__") or info.name.startswith("llmu.gpu_compile"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:  # e.g. nbgrader on a GPU image: no kernel lives there
            if exc.name and not exc.name.startswith("llmu"):
                print(f"note: {info.name} not searched for kernels: {exc.name} is not installed")
                continue
            raise
        for value in vars(module).values():
            if isinstance(value, JITFunction) and value.fn.__module__ == info.name:
                found[capture._kernel_name(value)] = value
    return found


def uncovered(kernels: dict, launched: set) -> list[str]:
    """Kernels neither compiled by a case nor called (directly or through another helper) from one."""
    reached = {capture._kernel_name(k) for k in launched}
    body = lambda fn: fn.src.split(")", 1)[-1]  # noqa: E731 - the source after the signature
    sources = [body(k) for k in launched]
    grew = True
    while grew:  # helpers called from helpers
        grew = False
        for name, fn in kernels.items():
            short = fn.fn.__name__
            # called, or passed as a function (tl.associative_scan(..., _combine))
            if name not in reached and any(re.search(rf"\b{short}\b", src) for src in sources):
                reached.add(name)
                sources.append(body(fn))
                grew = True
    return sorted(set(kernels) - reached)


def _run_case(case, dtype, target) -> list[str]:
    """Compile what ``case`` launches with ``dtype``; return problems found (rows go to the session)."""
    session = capture.SESSION
    session.case, session.dtype = case.name, _dtype_name(dtype)
    before = len(session.rows)
    checks.ACCEPTED_DTYPES = []
    problems = []
    try:
        case.run(dtype)
    except (ValueError, TypeError) as exc:
        cap = runtime.capability()
        refused = capture.Row(kernel="", case=case.name, target=target, dtype=session.dtype,
                              status="refused", message=str(exc).splitlines()[0][:300])
        if not (dtype == BF16 and cap is not None and cap < (8, 0) and "bfloat16" in str(exc)):
            refused.status = "error"
            problems.append(f"{case.name} [{session.dtype}, {target}]: the launcher refused: {exc}")
        session.rows.append(refused)
        return problems
    except Exception as exc:  # noqa: BLE001 - reported as a finding
        session.rows.append(capture.Row(kernel="", case=case.name, target=target, dtype=session.dtype,
                                        status="error", message=f"{type(exc).__name__}: {exc}"[:2000]))
        return [f"{case.name} [{session.dtype}, {target}]: {type(exc).__name__}: {exc}"]
    finally:
        accepted, checks.ACCEPTED_DTYPES = checks.ACCEPTED_DTYPES, None
    if len(session.rows) == before:
        problems.append(f"{case.name} [{session.dtype}, {target}]: launched no kernel")
    # Every float dtype accepted for an argument that was given this case's dtype must be a case dtype.
    wanted = {dt for _, dts, actual in accepted if actual == dtype for dt in dts if dt in FLOAT_DTYPES}
    missing = sorted(_dtype_name(dt) for dt in wanted - set(case.dtypes))
    if missing:
        problems.append(f"{case.name}: its launcher accepts {', '.join(missing)}, which the case does not compile")
    for row in session.rows[before:]:
        if row.status == "error":
            problems.append(f"{row.kernel} [{row.case}, {row.dtype}, {row.target}]: {row.message}")
    return problems


def _merge(rows: list) -> list:
    """One row per kernel × configuration × signature × target (several cases may compile the same)."""
    merged: dict = {}
    for row in rows:
        key = (row.kernel, row.config, row.signature, row.target, row.status, row.case if not row.kernel else "")
        if key in merged:
            if row.case not in merged[key].case.split(", "):
                merged[key].case += f", {row.case}"
        else:
            merged[key] = capture.Row(**row.as_dict())
    return list(merged.values())


def _print_table(rows: list) -> None:
    print(f"{'target':6}  {'kernel':42}  {'dtype':8}  {'shared':>8}  {'regs':>4}  {'spills':>6}  "
          f"{'status':7}  config")
    for r in sorted(rows, key=lambda r: (r.kernel or "~", r.target, r.dtype, r.config)):
        shared = "" if r.shared is None else f"{r.shared / 1024:.1f}K"
        spills = "" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        regs = "" if r.registers is None else str(r.registers)
        what = r.config if r.status == "ok" else f"{r.case}: {r.message}"
        print(f"{r.target:6}  {r.kernel or '(launcher)':42}  {r.dtype:8}  {shared:>8}  {regs:>4}  {spills:>6}  "
              f"{r.status:7}  {what}")


def read_record(path: str) -> dict:
    """The entries of a record file written by ``--write-record`` (``{}`` when there is none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise ValueError(f"{path}: not a gpu-compile record (no 'entries' mapping)")
    return data["entries"]


def write_record(path: str, rows: list, targets: list, partial: bool) -> int:
    """Write the record of ``rows`` to ``path``; entries of other targets already there are kept
    (and, after a partial run (``-k``), those of these targets too). Returns the number written."""
    kept = {h: e for h, e in read_record(path).items() if partial or e.get("target") not in targets}
    return write_entries(path, {**kept, **capture.record_entries(rows)})


def write_entries(path: str, entries: dict) -> int:
    """Write a record file holding ``entries`` (``{hash: outcome}``), sorted by hash."""
    import triton

    entries = dict(sorted(entries.items()))
    tmp = f"{path}.{os.getpid()}.tmp"
    about = ("llmu gpu-compile: what each compile gave, by Triton's hash of the compile; written by "
             "`make gpu-compile-record`, read by tests/test_gpu_compile.py")
    with open(tmp, "w") as f:   # one entry per line: a changed kernel is a readable diff
        f.write("{\n" + f'"about": {json.dumps(about)},\n"triton": {json.dumps(triton.__version__)},\n"entries": {{\n')
        f.write(",\n".join(f"{json.dumps(h)}: {json.dumps(e, sort_keys=True)}" for h, e in entries.items()))
        f.write("\n}\n}\n")
    os.replace(tmp, path)
    return len(entries)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="llmu gpu-compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default=",".join(TARGET_NAMES),
                        help="comma-separated, from " + ", ".join(capture.TARGETS))
    parser.add_argument("-k", dest="only", default=None, help="only cases whose name contains this text")
    parser.add_argument("--json", default=None, help="write every row and problem to this file")
    parser.add_argument("--quiet", action="store_true", help="print the problems and the summary only")
    parser.add_argument("--record", default=None, metavar="FILE",
                        help="take the outcome of a compile whose hash FILE holds from FILE instead of compiling "
                             "(the first launch of each kernel per target still compiles, and must agree)")
    parser.add_argument("--write-record", default=None, metavar="FILE",
                        help="write what every compile gave to FILE, by hash (only when there is no problem)")
    args = parser.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        if t not in capture.TARGETS:
            parser.error(f"--targets: unknown target {t!r}; choose from {', '.join(capture.TARGETS)}")
    if runtime.triton_mode() != "compile-only":
        print("llmu gpu-compile: this process was started without LLMU_COMPILE_ONLY=1; run `llmu gpu-compile`",
              file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message=".*FP_FUSION.*")
    torch.set_num_threads(1)
    capture.install()
    if args.record:
        capture.use_record(read_record(args.record))

    t0 = time.time()
    cases = [c for c in all_cases() if args.only is None or args.only in c.name]
    if not cases:
        parser.error(f"-k {args.only!r} matches no case")
    problems: list[str] = []
    for target in targets:
        with capture.compiling_for(target):
            for case in cases:
                for dtype in case.dtypes:
                    problems += _run_case(case, dtype, target)
    if args.only is None:
        missing = uncovered(llmu_kernels(), capture.SESSION.launched)
        problems += [f"{name}: no case compiles this kernel (add one to llmu/gpu_compile/cases.py)"
                     for name in missing]
    rows = _merge(capture.SESSION.rows)
    if not args.quiet:
        _print_table(rows)
    compiled = [r for r in rows if r.status == "ok"]
    kernels = {r.kernel for r in compiled}
    summary = (f"{len(compiled)} compiles of {len(kernels)} kernels for {', '.join(targets)} from {len(cases)} cases "
               f"in {time.time() - t0:.0f} s; {sum(r.status == 'refused' for r in rows)} refused by design; "
               f"{len(problems)} problems")
    # distinct compiles (hashes): a launch the JIT found in its own memory is not counted again
    compiled_here = {r.hash for r in capture.SESSION.rows if r.status == "ok" and r.source == "compiled"}
    recalled = {r.hash for r in capture.SESSION.rows if r.status == "ok" and r.source == "record"} - compiled_here
    if args.record:
        summary += (f"; {len(recalled)} of {len(recalled) + len(compiled_here)} configurations taken from the "
                    f"record {args.record}, {len(compiled_here)} compiled here")
    for p in problems:
        print("PROBLEM", p)
    print(summary)
    if args.write_record and not problems:
        n = write_record(args.write_record, capture.SESSION.rows, targets, partial=args.only is not None)
        print(f"wrote {n} compiles to the record {args.write_record}")
    if args.json:
        import triton

        with open(args.json, "w") as f:
            json.dump({"targets": targets, "triton": triton.__version__, "torch": torch.__version__,
                       "python": sys.version.split()[0], "summary": summary, "problems": problems,
                       "rows": [r.as_dict() for r in rows],
                       "compiles": {"compiled": len(compiled_here), "record": len(recalled)}}, f, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
