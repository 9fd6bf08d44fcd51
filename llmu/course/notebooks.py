"""Notebook editing helpers: read cells by grade_id, play a student, find solution regions."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from llmu.cell_module import module_cell, python_of, run_module_cell

from .paths import BEGIN_HIDDEN, BEGIN_SOLUTION, END_HIDDEN, END_SOLUTION


def cells_by_grade_id(path) -> dict[str, str]:
    """The source of every nbgrader cell of a notebook, keyed by its grade_id.

    Unit tests use it to run a notebook's exercise and test cells in-process, without a kernel.
    """
    nb = json.loads(Path(path).read_text())
    return {nbgrader_meta(c)["grade_id"]: "".join(c["source"]) for c in nb["cells"] if nbgrader_meta(c).get("grade_id")}


def setup_namespace(cells: dict[str, str]) -> dict:
    """A fresh namespace holding what a notebook's ``setup`` cell defines (without its environment
    printout): where unit tests run the notebook's exercise and test cells."""
    ns: dict = {}
    exec(cells["setup"].replace("print(environment())", ""), ns)  # noqa: S102 - the course's own cell
    return ns


def exec_cell(source: str, ns: dict, workdir, name: str = "cell") -> dict:
    """Run a notebook cell's code in the namespace ``ns``, as the notebook's kernel would; return ``ns``.

    Code that defines a ``@triton.jit`` kernel is compiled from a file ``workdir/name.py``: Triton
    reads a kernel's source text back (``inspect``), which needs a file behind the function. A
    ``%%module NAME`` cell is written to ``workdir/NAME.py`` and imported, as the magic does
    (:mod:`llmu.cell_module`).
    """
    if module_cell(source) is not None:         # %%module NAME: a .py file in workdir, imported
        run_module_cell(source, ns, workdir)
        return ns
    if "@triton.jit" in source:
        path = Path(workdir) / f"{name}.py"
        path.write_text(source, encoding="utf-8")
        code = compile(source, str(path), "exec")
    else:
        code = compile(source, f"<{name}>", "exec")
    exec(code, ns)  # noqa: S102 - the course's own notebook cells
    return ns


@dataclass(frozen=True)
class Exercise:
    """One graded exercise of a notebook, as the unit tests run it: the cells are named by grade_id."""

    solution: str                 # the cell the learner writes
    tests: tuple[str, ...]        # its graded test cells, in notebook order
    before: tuple[str, ...] = ()  # cells run before it: earlier solutions it builds on, helpers
    after: tuple[str, ...] = ()   # cells run after it: a launcher around the learner's kernel

    @classmethod
    def numbered(cls, n: int, *, before=(), after=()) -> Exercise:
        """Exercise ``n`` with the course's usual names: ``exN_solution``, ``test_exN_visible``,
        ``test_exN_hidden``."""
        return cls(f"ex{n}_solution", (f"test_ex{n}_visible", f"test_ex{n}_hidden"), tuple(before), tuple(after))


class NotebookExercises:
    """A notebook's graded exercises, run in-process without a kernel: how the unit tests play the
    instructor (every solution passes every test cell, hidden parts included) and a learner with a
    typical mistake (the test cell named for the mistake catches it).

    Use it as a context manager from a module-scoped fixture: the ``setup`` cell (and any
    ``setup_cells``) runs once, on first use, and what it holds (a model, perhaps) is dropped on
    exit. Each exercise runs in a
    copy of that namespace. ``on_kernel_device`` makes the kernel device torch's default device
    while cells run (cells that create tensors without naming a device; a no-op on a CPU).
    """

    def __init__(self, notebook, exercises: Mapping[str, Exercise], *, on_kernel_device: bool = False,
                 setup_cells: Iterable[str] = (), setup_hook=None):
        self.notebook = Path(notebook)
        self.cells = cells_by_grade_id(self.notebook)
        self.exercises = dict(exercises)
        for name, ex in self.exercises.items():
            missing = [c for c in (ex.solution, *ex.tests, *ex.before, *ex.after) if c not in self.cells]
            if missing:
                raise KeyError(f"{self.notebook.name}, exercise {name!r}: no cells {missing}")
        self.on_kernel_device = on_kernel_device
        self.setup_cells = tuple(setup_cells)  # locked cells after ``setup`` that the tests read
        self.setup_hook = setup_hook  # called with the namespace: stands in for slow cells (a training run)
        self._base: dict | None = None

    def __enter__(self) -> NotebookExercises:
        return self

    def __exit__(self, *exc) -> None:
        self._base = None

    def _device(self):
        import contextlib

        if not self.on_kernel_device:
            return contextlib.nullcontext()
        import torch

        from llmu.runtime import kernel_device

        dev = kernel_device()
        return contextlib.nullcontext() if dev.type == "cpu" else torch.device(dev)

    def namespace(self, exercise: str, workdir, source: str | None = None) -> dict:
        """The namespace after the exercise's cells ran, with ``source`` in place of its solution."""
        ex = self.exercises[exercise]
        if self._base is None:
            with self._device():
                base = setup_namespace(self.cells)
                for cell in self.setup_cells:
                    exec_cell(self.cells[cell], base, workdir, cell)
                if self.setup_hook is not None:
                    self.setup_hook(base)
            self._base = base
        ns = dict(self._base)
        with self._device():
            for cell in ex.before:
                exec_cell(self.cells[cell], ns, workdir, f"{exercise}_{cell}")
            exec_cell(self.cells[ex.solution] if source is None else source, ns, workdir, f"{exercise}_answer")
            for cell in ex.after:
                exec_cell(self.cells[cell], ns, workdir, f"{exercise}_{cell}")
        return ns

    def check_solution(self, exercise: str, workdir) -> None:
        """The instructor's solution passes every test cell of its exercise."""
        ns = self.namespace(exercise, workdir)
        with self._device():
            for cell in self.exercises[exercise].tests:
                exec_cell(self.cells[cell], ns, workdir, cell)  # hidden-test markers are comments: all of it runs

    def check_caught(self, exercise: str, old: str, new: str, test_cell: str, workdir) -> AssertionError:
        """The solution with ``old`` replaced by ``new`` fails ``test_cell`` with a check's
        ``AssertionError`` (the test cells before it run first, as in the notebook, and may fail
        in any way). Returns that error."""
        ex = self.exercises[exercise]
        solution = self.cells[ex.solution]
        if old not in solution:
            raise AssertionError(f"the solution of {exercise} no longer contains {old!r}: update the wrong answer")
        if test_cell not in ex.tests:
            raise KeyError(f"{test_cell!r} is not a test cell of {exercise} ({ex.tests})")
        ns = self.namespace(exercise, workdir, solution.replace(old, new))
        with self._device():
            for cell in ex.tests[: ex.tests.index(test_cell)]:
                try:
                    exec_cell(self.cells[cell], ns, workdir, cell)
                except Exception:  # noqa: BLE001 - an earlier test may fail on the wrong answer too
                    pass
            try:
                exec_cell(self.cells[test_cell], ns, workdir, test_cell)
            except AssertionError as exc:
                return exc
        raise AssertionError(f"test cell {test_cell!r} passed: it does not catch this wrong answer")


    def own_work_calls(self, exercise: str) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
        """For each test cell of ``exercise``, its ``check_own_work`` calls: (the submission's
        name, the answers as written)."""
        return {cell: own_work_calls_in(self.cells[cell], f"{self.notebook.name} {cell}")
                for cell in self.exercises[exercise].tests}

    def check_library_answer_fails(self, exercise: str, workdir) -> list[str]:
        """A learner who hands back llmu's answer (an alias, or a wrapper through a helper; a
        subclass for a class) fails every test cell of ``exercise`` with the own-work message.
        Returns the cases tried."""
        from llmu.grading import CheckFailed

        ex = self.exercises[exercise]
        calls = self.own_work_calls(exercise)
        unchecked = [cell for cell, found in calls.items() if not found]
        if unchecked:
            raise AssertionError(f"{self.notebook.name} {exercise}: test cells {unchecked} never call check_own_work, "
                                 "so a learner who returns llmu's own answer passes them")
        submissions: dict[str, str] = {}
        for found in calls.values():
            for name, answers in found:
                submissions.setdefault(name, answers[0])
        tried = []
        for name, answer in submissions.items():
            for variant in ("alias", "wrapper"):
                case = f"{name} = {answer} ({variant})"
                source = self.cells[ex.solution] + "\n" + library_answer_cheat(name, answer, variant)
                ns = self.namespace(exercise, workdir, source)
                for cell in ex.tests:
                    try:
                        with self._device():
                            exec_cell(self.cells[cell], ns, workdir, cell)
                    except Exception as exc:  # noqa: BLE001 - which failure it was is the finding
                        if not (isinstance(exc, CheckFailed) and "a ready-made answer to this exercise" in str(exc)):
                            raise AssertionError(f"{case}: {cell} failed with {type(exc).__name__} before its "
                                                 f"own-work check (make check_own_work the cell's first line): "
                                                 f"{exc}") from exc
                    else:
                        raise AssertionError(f"{case}: test cell {cell!r} passed llmu's own answer")
                tried.append(case)
        return tried

    def check_bench_yours(self, workdir, exercise_for: Mapping[str, str], bench_cell: str = "bench",
                          sizes: Mapping[str, dict] | None = None) -> dict[str, str]:
        """The benchmark cell hands each learner kernel to ``llmu.bench.run(..., yours={...})`` the
        way llmu's kernel of that entry is called: with the instructor's solution of exercise
        ``exercise_for[entry]`` in place, the function the cell passes for ``entry`` gives llmu's
        kernel's output on the entry's inputs (its first CPU size, or ``sizes[entry]``), here in
        Triton's interpreter. On a GPU that comparison gates the learner's timing row; this runs
        it where the suite runs. Returns ``{entry: "ok"}``; raises AssertionError naming what differs.
        """
        from llmu.bench import load_all
        from llmu.bench.runner import YOURS, _checked, _with_yours
        from llmu.runtime import kernel_device

        given = _yours_in_cell(self.cells[bench_cell], f"{self.notebook.name} {bench_cell}")
        if sorted(given) != sorted(exercise_for):
            raise AssertionError(f"{self.notebook.name} {bench_cell}: yours= names {sorted(given)}, "
                                 f"the test expects {sorted(exercise_for)}")
        registry = load_all()
        checked = {}
        for entry_name, exercise in exercise_for.items():
            ns = self.namespace(exercise, workdir)
            with self._device():
                fn = eval(compile(given[entry_name], f"{bench_cell}:yours[{entry_name!r}]", "eval"), ns)  # noqa: S307
                (entry,) = _with_yours([registry[entry_name]], {entry_name: fn})
                size = dict((sizes or {}).get(entry_name) or entry.cpu_sizes[0])
                inputs = entry.setup(size, kernel_device(), entry.cpu_dtype)
                inputs = inputs if isinstance(inputs, tuple) else (inputs,)
                why = _checked(entry.providers[YOURS], entry, inputs)  # what gates the timing on a GPU
            if why:
                raise AssertionError(f"{self.notebook.name} {bench_cell}: yours[{entry_name!r}] with the solution of "
                                     f"{exercise}, at {size}: {why}")
            checked[entry_name] = "ok"
        return checked


def _yours_in_cell(source: str, where: str) -> dict[str, str]:
    """The ``yours={...}`` literal of the ``llmu.bench.run`` call in ``source``: entry -> expression."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and any(k.arg == "yours" for k in node.keywords):
            value = next(k.value for k in node.keywords if k.arg == "yours")
            if not isinstance(value, ast.Dict) or not all(isinstance(k, ast.Constant) for k in value.keys):
                raise AssertionError(f"{where}: yours= must be a dict literal of entry names")
            return {k.value: ast.unparse(v) for k, v in zip(value.keys, value.values)}
    raise AssertionError(f"{where}: no llmu.bench.run(..., yours={{...}}) call: the learner's kernel is never timed")


def _callee(func) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def own_work_calls_in(source: str, where: str = "cell") -> list[tuple[str, tuple[str, ...]]]:
    """The ``check_own_work`` calls of a test cell's source: (the submission's name, the answers as
    written), in order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and _callee(node.func) == "check_own_work"):
            continue
        if len(node.args) < 2 or not isinstance(node.args[0], ast.Name):
            raise AssertionError(f"{where}: check_own_work(submission_name, answer, ..., what=...) expected, "
                                 f"got {ast.unparse(node)}")
        found.append((node.args[0].id, tuple(ast.unparse(a) for a in node.args[1:])))
    return found


def library_answer_cheat(name: str, answer: str, variant: str = "alias") -> str:
    """Code appended to a solution cell that replaces ``name`` by llmu's ``answer``, as a learner
    could: the answer itself, or a function that only calls it through a helper (a subclass, for
    a class; a Triton kernel cannot be wrapped, so it is aliased)."""
    lines = ["from llmu.grading.own_work import resolve as _resolve",
             f"_library_answer = _resolve({answer})"]
    if variant == "alias":
        lines.append(f"{name} = _library_answer")
    else:
        lines += ["if isinstance(_library_answer, type):",
                  f"    class {name}(_library_answer):",
                  "        pass",
                  "elif hasattr(_library_answer, 'fn'):  # a Triton kernel",
                  f"    {name} = _library_answer",
                  "else:",
                  "    def _helper(*args, **kwargs):",
                  "        return _library_answer(*args, **kwargs)",
                  "",
                  f"    def {name}(*args, **kwargs):",
                  "        return _helper(*args, **kwargs)"]
    return "\n".join(lines) + "\n"


def exercise_tests(notebook, exercises: Mapping[str, Exercise], wrong: Mapping[str, tuple], *,
                   warnings_to_ignore: Iterable[str] = (), **options):
    """The tests every notebook's exercise file runs, for pytest to collect from its module:

        (notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
         test_library_answers_fail) = course.exercise_tests(NOTEBOOK, EXERCISES, WRONG)

    ``notebook`` is a module-scoped fixture holding a :class:`NotebookExercises` (``options`` go
    to it); the first test runs each exercise's solution against all its test cells; the second
    applies each wrong answer of ``wrong`` (case -> (exercise, old text, new text, test cell)) and
    expects the named test cell to catch it; the third hands in llmu's own answer to each
    exercise and expects every test cell to refuse it. ``warnings_to_ignore`` are pytest warning
    filters for the wrong answers (a NaN a wrong kernel produces, say).
    """
    import pytest

    @pytest.fixture(scope="module", name="notebook")
    def notebook_fixture():
        with NotebookExercises(notebook, exercises, **options) as runner:
            yield runner

    @pytest.mark.parametrize("exercise", list(exercises))
    def test_solutions_pass_all_tests(exercise, notebook, tmp_path):
        notebook.check_solution(exercise, tmp_path)

    @pytest.mark.parametrize("case", list(wrong))
    def test_wrong_answers_fail(case, notebook, tmp_path):
        notebook.check_caught(*wrong[case], workdir=tmp_path)

    @pytest.mark.parametrize("exercise", list(exercises))
    def test_library_answers_fail(exercise, notebook, tmp_path):
        notebook.check_library_answer_fails(exercise, tmp_path)

    for spec in warnings_to_ignore:
        test_wrong_answers_fail = pytest.mark.filterwarnings(spec)(test_wrong_answers_fail)
    return notebook_fixture, test_solutions_pass_all_tests, test_wrong_answers_fail, test_library_answers_fail


def nbgrader_meta(cell) -> dict:
    return dict(cell.get("metadata", {}).get("nbgrader", {}))


def is_solution(cell) -> bool:
    return bool(nbgrader_meta(cell).get("solution"))


def is_grade(cell) -> bool:
    return bool(nbgrader_meta(cell).get("grade"))


def is_test(cell) -> bool:
    """An autograder test cell: graded code that is not itself an answer."""
    m = nbgrader_meta(cell)
    return cell.get("cell_type") == "code" and bool(m.get("grade")) and not m.get("solution")


def is_written(cell) -> bool:
    """A written answer: a markdown cell that is both an answer and graded, which a person grades
    (nbgrader's "manually graded answer"). Its solution region holds the model answer and the
    rubric (:func:`rubric_of`); the student copy keeps the text around it (the question) and gets
    :data:`TEXT_STUB` in place of the region."""
    m = nbgrader_meta(cell)
    return cell.get("cell_type") == "markdown" and bool(m.get("grade")) and bool(m.get("solution"))


#: The line that opens a written answer's rubric, inside its solution region.
RUBRIC_HEADING = re.compile(r"^\*\*Rubric\*\*", re.M)
#: One rubric item: ``- **2 points** what the answer must say``.
RUBRIC_ITEM = re.compile(r"^- \*\*(?P<points>\d+(?:\.\d+)?) points?\*\*\s*(?P<text>.+)$", re.M)


def rubric_of(source: str) -> str:
    """The rubric of a written answer's instructor source: the lines of its solution region from
    the ``**Rubric**`` line on (what a grader looks for; the model answer stands before it).
    Empty when the cell has no rubric."""
    region = solution_region(source)
    body = region[1] if region else source
    m = RUBRIC_HEADING.search(body)
    return body[m.start():].strip() if m else ""


def rubric_points(rubric: str) -> list[tuple[float, str]]:
    """The items of a rubric (:func:`rubric_of`): ``[(points, what earns them), ...]``."""
    return [(float(m["points"]), m["text"].strip()) for m in RUBRIC_ITEM.finditer(rubric)]


def solution_region(source: str) -> tuple[str, str, str] | None:
    """Split ``source`` into (before, the solution lines, after) around the solution markers."""
    m = re.search(rf"^([ \t]*){re.escape(BEGIN_SOLUTION)}[^\n]*\n(.*?)^[ \t]*{re.escape(END_SOLUTION)}[^\n]*$",
                  source, flags=re.S | re.M)
    if not m:
        return None
    return source[: m.start()], m.group(2), source[m.end():]


def solution_code_lines(source: str) -> int:
    """Lines of code a learner writes in ``source``: the non-blank, non-comment lines of every
    solution region of the cell (a cell may hold several, one per function). How the course
    counts the depth of an exercise; a cell without markers counts 0."""
    regions = re.findall(rf"^[ \t]*{re.escape(BEGIN_SOLUTION)}[^\n]*\n(.*?)^[ \t]*{re.escape(END_SOLUTION)}",
                         source, flags=re.S | re.M)
    return sum(1 for region in regions for line in region.splitlines()
               if line.strip() and not line.strip().startswith("#"))


def answer_from_solution(source: str) -> str:
    """The solution cell's source as a student would type it: the markers removed."""
    return "\n".join(
        line for line in source.split("\n") if line.strip() not in (BEGIN_SOLUTION, END_SOLUTION)
    )




_HIDDEN_REGION = re.compile(rf"{re.escape(BEGIN_HIDDEN)}.*?{re.escape(END_HIDDEN)}\n?", re.S)


def without_hidden_tests(source: str) -> str:
    """A cell's source as the learner's copy holds it: every hidden-test region removed."""
    return _HIDDEN_REGION.sub("", source)


#: Locked cells a test may read besides the setup and solution cells: the launcher around a
#: learner's kernel, a reference or harness placed before the exercise, the model the finale builds on.
HELPER_CELL = re.compile(r"(launcher|reference|harness|helpers?)$|^finale_model$")


def _bound_and_read(source: str) -> tuple[set[str], set[str]]:
    """Names a cell binds anywhere (arguments and loop variables included), and names it reads."""
    bound, read = set(), set()
    for node in ast.walk(ast.parse(python_of(source))):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return bound, read


def _globals_defined(source: str) -> set[str]:
    """The global names a cell defines (not a function's arguments or locals)."""
    names: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(child.name)
            elif isinstance(child, ast.alias):
                names.add((child.asname or child.name).split(".")[0])
            elif isinstance(child, ast.Name) and not isinstance(child.ctx, ast.Load):
                names.add(child.id)
            elif not isinstance(child, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                visit(child)

    visit(ast.parse(python_of(source)))
    return names


def demo_names_read_by_tests(path) -> dict[str, list[str]]:
    """``{test cell grade_id: names}`` for every graded cell that reads a global only a demo,
    widget or benchmark cell defined (not the setup cell, a solution, an earlier graded cell or a
    :data:`HELPER_CELL`): a test that would break, or grade differently, when a learner skips or
    edits a demo. Empty when every test builds what it needs."""
    allowed: set[str] = set()
    demo: set[str] = set()
    found: dict[str, list[str]] = {}
    for cell in json.loads(Path(path).read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "code":
            continue
        meta = nbgrader_meta(cell)
        gid, source = meta.get("grade_id", ""), "".join(cell["source"])
        if meta.get("grade"):
            bound, read = _bound_and_read(source)
            used = (read - bound) & (demo - allowed)
            if used:
                found[gid] = sorted(used)
            allowed |= _globals_defined(source)
        elif gid == "setup" or meta.get("solution") or HELPER_CELL.search(gid):
            allowed |= _globals_defined(source)
        else:
            demo |= _globals_defined(source)
    return found
