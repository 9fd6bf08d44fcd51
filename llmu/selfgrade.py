"""Grade your own notebook, outside a class: ``llmu grade course/00_welcome/00_welcome.ipynb``.

A released notebook carries its visible tests; the hidden ones live only in the instructor's
copy, ``solutions/NN_topic/NN_topic.ipynb``. Self-grading does what nbgrader's autograde does
for a class, for one learner and without a gradebook:

1. copy the learner's notebook into a temporary folder (the original is only read, never written);
2. find the instructor notebook with the same file name and put every graded test cell back from
   it, hidden tests included (an edited or deleted test cannot change the score);
3. run the copy top to bottom in a fresh kernel (a separate process), each cell limited to
   ``cell_timeout`` seconds (interrupted, then the run goes on) and the kernel's memory to
   ``memory_mb`` (a watchdog kills a kernel that grows past it). Cells that cannot change the
   score are left out (:func:`cells_to_skip`): the instructor's own cells (a model loaded for a
   picture, a training demo, a benchmark) that read nothing your answers bind and that no cell
   which runs needs, as ``llmu.course.cell_deps`` decides from the names each cell binds and
   reads. ``all_cells=True`` runs every cell, as a class's autograde does; ``exercise=N`` runs
   only exercise N's answers and tests and what they need;
4. score each graded test cell: its points when it ran without an error, else 0, and group the
   cells into the exercises of the notebook (the ``### Exercise N · Title (a + b points)``
   headings; without headings, by the test cells' names).
5. a written answer (a markdown cell a person grades: an experiment's analysis, say) is not
   scored here: the report says whether it holds an answer yet and, after the attempt, shows the
   rubric a grader applies (from the instructor notebook), so a learner studying alone can grade
   it against the rubric. In a class the instructor grades it (nbgrader's formgrader).

The result is a per-exercise table (:func:`format_report`) in which a failed check shows its own
message in full under its exercise (which property broke, by how much, and where to look),
never the test's source, so the hidden tests stay hidden. A cell that ran out of time, a test
cell that was deleted and the exercises left when the kernel died are reported per exercise,
with the reason.

The kernel runs with ``LLMU_AUTOGRADING=1`` (:data:`llmu.course.AUTOGRADING_ENV`): benchmark
cells skip themselves, as they do in a class's autograde.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from llmu import course
from llmu.kernel_client import poll_in_slices

#: Kernel memory limit (MiB) unless one is given. The course's hungriest notebook peaked at about
#: 1.6 GiB (10_quantization; test-artifacts/notebooks/ records every notebook's peak).
MEMORY_MB = 4096
#: How often the memory watchdog looks at the kernel's resident memory (seconds).
WATCH_INTERVAL_S = 0.2

#: Cell outcomes, as the table prints them.
PASSED, FAILED, TIMED_OUT, NOT_RUN, MISSING = "passed", "failed", "timed out", "not run", "missing"
#: A written answer's outcome: answered (to be graded by a person), or still the stub.
WRITTEN, UNANSWERED = "written", "not answered yet"

class SelfGradeError(ValueError):
    """Self-grading cannot start: a bad path, or no instructor notebook matches the learner's."""


class KernelStartError(RuntimeError):
    """The Jupyter kernel that runs the notebook did not start (``llmu doctor`` checks the kernel)."""


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass
class CellOutcome:
    """One graded test cell: what it is worth and what happened to it."""

    grade_id: str
    points: float
    score: float = 0.0
    status: str = NOT_RUN
    #: Why it lost its points: the check's whole message, the timeout, the kernel's death.
    message: str = ""
    seconds: float | None = None
    #: A written answer (graded by a person, never here): its rubric, and the words the learner wrote.
    written: bool = False
    rubric: str = ""
    words: int = 0


@dataclass
class ExerciseResult:
    """The graded cells under one exercise heading."""

    title: str
    cells: list[CellOutcome] = field(default_factory=list)
    #: N of its ``### Exercise N`` heading (None for cells grouped by name, without headings)
    number: int | None = None

    @property
    def score(self) -> float:
        """Points of the auto-graded cells (a written answer is graded by a person)."""
        return sum(c.score for c in self.cells if not c.written)

    @property
    def max_score(self) -> float:
        return sum(c.points for c in self.cells if not c.written)

    @property
    def written(self) -> list[CellOutcome]:
        """The exercise's written answers."""
        return [c for c in self.cells if c.written]

    @property
    def written_points(self) -> float:
        return sum(c.points for c in self.written)

    @property
    def status(self) -> str:
        """One line: ``passed`` when every auto-graded cell passed, else the first lost cell's
        status and the first line of its message (:attr:`messages` has them in full)."""
        lost = next((c for c in self.cells if c.status != PASSED and not c.written), None)
        if lost is None:
            return PASSED
        first = _first_line(lost.message)
        return f"{lost.status}: {first}" if first else lost.status

    @property
    def messages(self) -> list[str]:
        """The whole message of every cell that lost points, in order, each once (the visible and
        the hidden test of an unanswered exercise say the same thing)."""
        return list(dict.fromkeys(c.message for c in self.cells
                                  if c.status != PASSED and c.message and not c.written))


@dataclass
class SelfGradeReport:
    notebook: Path
    solution: Path
    exercises: list[ExerciseResult]
    seconds: float = 0.0
    #: Why the run stopped early (the kernel died or was stopped); empty when it ran to the end.
    stopped: str = ""
    #: The code cells left out (see :func:`cells_to_skip`), and the one exercise graded (or None).
    skipped: int = 0
    exercise: int | None = None

    @property
    def score(self) -> float:
        return sum(e.score for e in self.exercises)

    @property
    def max_score(self) -> float:
        return sum(e.max_score for e in self.exercises)

    @property
    def written_points(self) -> float:
        """Points of the written answers, which a person grades (not in :attr:`max_score`)."""
        return sum(e.written_points for e in self.exercises)

    @property
    def cells(self) -> dict[str, CellOutcome]:
        return {c.grade_id: c for e in self.exercises for c in e.cells}


# ---------------------------------------------------------------------------------------------
# Finding the instructor notebook
# ---------------------------------------------------------------------------------------------


#: What copying adds to a notebook's name: JupyterLab's Duplicate ("NN_x-Copy1"), a browser's
#: second download ("NN_x (1)"), Colab's "Copy of NN_x". :func:`original_stem` strips them.
_COPY_SUFFIX = re.compile(r"(?:-Copy\d*|\s*\(\d+\))$", re.IGNORECASE)
_COPY_PREFIX = re.compile(r"^Copy of\s+", re.IGNORECASE)


def original_stem(name: str) -> str:
    """The name a copy was made from: ``00_welcome-Copy1 (1).ipynb`` -> ``00_welcome``."""
    stem = Path(name).stem.strip()
    while True:
        shorter = _COPY_PREFIX.sub("", _COPY_SUFFIX.sub("", stem)).strip()
        if shorter == stem or not shorter:
            return stem
        stem = shorter


def find_solution(notebook: str | os.PathLike, root=None) -> Path:
    """The instructor notebook that matches ``notebook``.

    By file name first: ``course/NN_x/NN_x.ipynb``, or any file named ``NN_x.ipynb``, matches
    ``solutions/NN_x/NN_x.ipynb``, and so do its copies ``NN_x-Copy1.ipynb`` (JupyterLab's
    Duplicate), ``NN_x (1).ipynb`` (a second download) and ``Copy of NN_x.ipynb`` (Colab). A name
    that holds exactly one assignment's name (``ada_NN_x.ipynb``) matches it. When nothing matches
    (``Untitled.ipynb``), the error says how to name the instructor notebook
    (``llmu grade NOTEBOOK --solution PATH``) and lists the known ones.
    """
    nb = Path(notebook)
    src = course.solutions_dir(root)
    known = course.source_notebooks(root)
    if not known:
        raise SelfGradeError(f"no instructor notebooks in {src}: self-grading needs the course's solutions/ "
                             "folder (set LLMU_COURSE_ROOT to a checkout of the course)")
    for stem in dict.fromkeys((nb.stem, original_stem(nb.name))):
        same_name = [p for p in known if p.stem == stem]
        if len(same_name) == 1:
            return same_name[0]
    # Renamed copies: the longest assignment name inside the file name ("ada_00_welcome").
    inside = sorted((p for p in known if p.stem in nb.stem), key=lambda p: len(p.stem), reverse=True)
    if inside and (len(inside) == 1 or len(inside[0].stem) > len(inside[1].stem)):
        return inside[0]
    names = ", ".join(p.name for p in known)
    # The example names the assignment of the folder the notebook is in, when it is one.
    example = next((p for p in known if p.stem == nb.resolve().parent.name), known[0])
    shown = os.path.relpath(example)
    example = shown if not shown.startswith("..") else example
    raise SelfGradeError(
        f"notebook {str(notebook)!r}: no instructor notebook in {src} has its name (self-grading matches by "
        "file name; copies such as NN_topic-Copy1.ipynb and 'NN_topic (1).ipynb' count)\n"
        f"  known: {names}\n"
        f"  fix: name the instructor notebook to grade against: "
        f"llmu grade {shlex.quote(str(notebook))} --solution {shlex.quote(str(example))}")


# ---------------------------------------------------------------------------------------------
# Preparing the copy that is run
# ---------------------------------------------------------------------------------------------


def _grade_id(cell) -> str | None:
    return course.nbgrader_meta(cell).get("grade_id")


def _exercises_of(solution_nb) -> list[ExerciseResult]:
    """The exercises of the instructor notebook and their graded test cells, in notebook order.

    A graded cell belongs to the exercise heading above it. Graded cells before any heading (a
    notebook without them) are grouped by name: ``test_add_visible`` and ``test_add_hidden`` make
    the exercise ``add``.
    """
    exercises: list[ExerciseResult] = []
    for heading, cells in course.exercise_groups(solution_nb.cells):
        outcomes = [CellOutcome(_grade_id(c), float(course.nbgrader_meta(c).get("points") or 0),
                                written=course.is_written(c),
                                rubric=course.rubric_of(c.source) if course.is_written(c) else "")
                    for c in cells]
        if heading is not None:
            exercises.append(ExerciseResult(f"{heading['number']} · {heading['title'].strip() or 'exercise'}", outcomes,
                                            int(heading["number"])))
            continue
        by_prefix: dict[str, ExerciseResult] = {}
        for outcome in outcomes:  # no heading above them: group by the test cells' names
            prefix = re.sub(r"^test_|_(visible|hidden|\d+)$", "", outcome.grade_id)
            if prefix not in by_prefix:
                by_prefix[prefix] = ExerciseResult(prefix)
                exercises.append(by_prefix[prefix])
            by_prefix[prefix].cells.append(outcome)
    return [e for e in exercises if e.cells]


def prepare(learner_nb, solution_nb) -> tuple[object, list[str]]:
    """The notebook to run: the learner's cells, with every graded test cell's source, metadata
    and kind put back from the instructor notebook (hidden tests included). Returns it and the
    grade_ids of the test cells the learner's notebook lacks."""
    import copy

    tests = {_grade_id(c): c for c in solution_nb.cells if course.is_test(c)}
    nb = copy.deepcopy(learner_nb)
    seen = set()
    for i, cell in enumerate(nb.cells):
        gid = _grade_id(cell)
        if gid in tests and gid not in seen:
            seen.add(gid)
            restored = copy.deepcopy(tests[gid])
            restored["outputs"], restored["execution_count"] = [], None
            nb.cells[i] = restored
    return nb, [g for g in tests if g not in seen]


def _answer_words(learner_cell, solution_cell) -> int:
    """How many words the learner wrote in a written answer: the cell's words once the question
    (the instructor's text around the solution region, wherever it stands) and the stub are taken
    out, so that a cell that only repeats the question holds no answer."""
    before, _, after = course.solution_region(solution_cell.source) or ("", "", "")
    text = learner_cell.source
    for given in (before.strip(), after.strip(), course.TEXT_STUB):
        if given:
            text = text.replace(given, " ")
    return len(re.findall(r"\w+", text))


def _written_outcomes(learner_nb, solution_nb, outcomes: dict[str, CellOutcome]) -> None:
    """Fill in the written answers' outcomes from the learner's notebook (never scored here)."""
    solution_cells = {_grade_id(c): c for c in solution_nb.cells if course.is_written(c)}
    learner_cells = {_grade_id(c): c for c in learner_nb.cells if c.cell_type == "markdown"}
    for gid, outcome in outcomes.items():
        if not outcome.written:
            continue
        if gid not in learner_cells:
            outcome.status, outcome.message = MISSING, "this written answer's cell is not in your notebook"
            continue
        outcome.words = _answer_words(learner_cells[gid], solution_cells[gid])
        outcome.status = WRITTEN if outcome.words else UNANSWERED


def exercise_numbers(nb) -> dict[int, int]:
    """``{cell index: N}`` for the cells that stand under a ``### Exercise N`` heading (and before
    the next one); cells before the first heading are not in it."""
    numbers, current = {}, None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                m = course.EXERCISE_HEADING.match(line)
                if m:
                    current = int(m["number"])
        elif current is not None:
            numbers[i] = current
    return numbers


def cells_to_skip(nb, solution_nb, exercise: int | None = None) -> dict[int, str]:
    """``{cell index: why}``: the code cells of ``nb`` (the notebook :func:`prepare` made) that
    grading leaves out, because they cannot change the score.

    The whole notebook: the cells the release check leaves out (``llmu.course.cell_deps``): the
    instructor's own cells, unchanged, that read nothing an answer binds (directly or through
    another cell) and that no cell which runs needs. Every answer, every test, every cell you
    added or changed, and every cell downstream of your answers runs. One exercise
    (``exercise=N``): only its answer and test cells, and the cells they need.
    """
    if exercise is None:
        return {i: "cannot change the score: the instructor's cell, reading nothing your answers bind"
                for i in course.release_check_skips(nb, solution_nb, course.is_solution, course.is_test)}
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    numbers = exercise_numbers(nb)
    seeds = {k for k, i in enumerate(code)
             if numbers.get(i) == exercise and (course.is_solution(nb.cells[i]) or course.is_test(nb.cells[i]))}
    raising = {k for k, i in enumerate(code) if course.is_test(nb.cells[i])}
    run = course.cells_to_run([nb.cells[i].source for i in code], seeds, raising, taint=False)
    return {i: f"not needed to grade exercise {exercise}" for k, i in enumerate(code) if k not in run}


# ---------------------------------------------------------------------------------------------
# Memory watchdog
# ---------------------------------------------------------------------------------------------


class MemoryWatchdog:
    """Kill a process (and its children) when their resident memory together passes ``limit_mb``.

    A watchdog rather than ``RLIMIT_AS``: a kernel's address space is not the memory it uses
    (running 05_prefill_decode it held 2.4-2.6 GB of address space for 1.3-1.5 GB resident, and
    the gap grows with the number of threads, each of which gets its own malloc arena), so an
    address-space limit would have to guess that gap; and a failed allocation inside a C
    extension does not always surface as a Python ``MemoryError``. Resident memory is what a
    machine runs out of. The check runs every :data:`WATCH_INTERVAL_S` seconds; :attr:`tripped` holds the
    peak that was seen when the process was killed.
    """

    def __init__(self, pid: int, limit_mb: float, interval_s: float = WATCH_INTERVAL_S):
        import psutil

        self._process = psutil.Process(pid)
        self.limit_mb = float(limit_mb)
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self.tripped: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="llmu-memory-watchdog", daemon=True)

    def _rss_mb(self) -> float:
        import psutil

        procs = [self._process]
        try:
            procs += self._process.children(recursive=True)
        except psutil.Error:
            pass
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total / 2**20

    def _watch(self) -> None:
        import psutil

        while not self._stop.wait(self.interval_s):
            try:
                if not self._process.is_running():
                    return
                rss = self._rss_mb()
            except psutil.Error:
                return
            self.peak_mb = max(self.peak_mb, rss)
            if rss > self.limit_mb:
                self.tripped = rss
                for p in [*self._process.children(recursive=True), self._process]:
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------

#: A failed cell's message is shown in full up to this many lines (an exception can carry the
#: repr of a whole tensor); the rest is counted, not printed.
MESSAGE_LINES = 30


def _first_line(text: str) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text or "").strip()
    return text.splitlines()[0].strip() if text else ""


def _whole_message(text: str) -> str:
    """An exception's message as the learner should read it: without terminal colours, blank
    lines at either end or trailing spaces, its own line breaks and indents kept."""
    lines = [ln.rstrip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", text or "").splitlines()]
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    if lines:
        lines[0] = lines[0].lstrip()
    if len(lines) > MESSAGE_LINES:
        lines = lines[:MESSAGE_LINES] + [f"... ({len(lines) - MESSAGE_LINES} more lines)"]
    return "\n".join(lines)


def _error_message(reply_content: dict) -> str:
    """What a failed test cell says: the exception's name (unless it is a failed check) and its
    whole message, which for llmu.grading's checks ends with where to look."""
    ename, evalue = reply_content.get("ename", "Error"), _whole_message(reply_content.get("evalue", ""))
    if ename == "NotImplementedError" or evalue.startswith("NotImplementedError"):
        # The released stub (Triton's interpreter reports it as an InterpreterError).
        return "not answered yet (NotImplementedError)"
    if ename in ("AssertionError", "CheckFailed") and evalue:
        return evalue
    return f"{ename}: {evalue}" if evalue else ename


def self_grade(notebook: str | os.PathLike, *, solution: str | os.PathLike | None = None, root=None,
               cell_timeout: float = course.CELL_TIMEOUT, memory_mb: float | None = MEMORY_MB,
               kernel_name: str | None = None, progress: Callable[[str], None] | None = None,
               exercise: int | None = None, all_cells: bool = False) -> SelfGradeReport:
    """Grade ``notebook`` against the hidden tests of its instructor notebook; see the module text.

    ``solution``: the instructor notebook (default: :func:`find_solution`). ``cell_timeout``:
    seconds per cell. ``memory_mb``: the kernel's memory limit (None or 0: none). ``kernel_name``:
    the Jupyter kernel (default: the notebook's own, ``python3``). ``progress(line)`` is called
    as each code cell finishes. ``exercise``: grade exercise N only (the report holds that one).
    ``all_cells``: run every cell, the ones that cannot change the score too. The learner's file
    is read once and never written.
    """
    # The limits first, before anything is read. Cells are timed in whole seconds, and a limit that
    # rounds down to 0 would mean no limit at all: an endless loop would hang the grading.
    if isinstance(cell_timeout, bool) or not isinstance(cell_timeout, (int, float)):
        raise TypeError(f"cell_timeout must be a number of seconds, got {cell_timeout!r}")
    if not 1 <= cell_timeout < float("inf"):  # also refuses NaN
        raise SelfGradeError(f"cell_timeout must be a finite number of seconds >= 1, got {cell_timeout!r}")
    if memory_mb is not None and (isinstance(memory_mb, bool) or not isinstance(memory_mb, (int, float))):
        raise TypeError(f"memory_mb must be a number of megabytes or None, got {memory_mb!r}")
    if exercise is not None and (isinstance(exercise, bool) or not isinstance(exercise, int)):
        raise TypeError(f"exercise must be an exercise number (int) or None, got {exercise!r}")
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    path = Path(notebook)
    if path.suffix != ".ipynb":
        raise SelfGradeError(f"notebook must be an .ipynb file, got {str(notebook)!r}")
    if not path.is_file():
        raise SelfGradeError(f"notebook {str(notebook)!r} does not exist")
    if memory_mb is not None and memory_mb < 0:
        raise SelfGradeError(f"memory_mb must be >= 0 (0: no limit), got {memory_mb!r}")
    solution_path = Path(solution) if solution is not None else find_solution(path, root)
    say = progress or (lambda line: None)

    try:
        learner_nb = nbformat.reads(path.read_text(encoding="utf-8"), as_version=4)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the learner's to fix
        raise SelfGradeError(f"notebook {str(notebook)!r} is not a readable notebook: {exc}") from exc
    solution_nb = nbformat.read(str(solution_path), as_version=4)
    exercises = _exercises_of(solution_nb)
    if exercise is not None:
        numbers = [e.number for e in exercises if e.number is not None]
        if exercise not in numbers:
            raise SelfGradeError(f"exercise must be one of {numbers} (the exercises of {solution_path.name}), "
                                 f"got {exercise}")
        exercises = [e for e in exercises if e.number == exercise]
    outcomes = {c.grade_id: c for e in exercises for c in e.cells}
    nb, missing = prepare(learner_nb, solution_nb)
    for gid in missing:
        if gid in outcomes:
            outcomes[gid].status, outcomes[gid].message = MISSING, "this test cell is not in your notebook"
    _written_outcomes(learner_nb, solution_nb, outcomes)
    skips = {} if all_cells else cells_to_skip(nb, solution_nb, exercise)

    t_start = time.perf_counter()
    report = SelfGradeReport(notebook=path, solution=solution_path, exercises=exercises, exercise=exercise)
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]
    replies: dict[int, dict] = {}

    def on_cell_executed(cell, cell_index, execute_reply):
        replies[cell_index] = (execute_reply or {}).get("content", {})

    kernel = kernel_name or nb.metadata.get("kernelspec", {}).get("name", "python3")
    with tempfile.TemporaryDirectory(prefix="llmu-selfgrade-") as work, ExitStack() as stack:
        # The kernel works in a temporary folder that holds a copy of the learner's file.
        shutil.copy(path, Path(work) / path.name)
        client = NotebookClient(
            nb, timeout=int(cell_timeout), kernel_name=kernel, allow_errors=True, interrupt_on_timeout=True,
            error_on_timeout={"ename": course.TIMEOUT_ERROR, "evalue": f"the cell ran longer than {cell_timeout:g} s",
                              "traceback": []},
            resources={"metadata": {"path": work}}, on_cell_executed=on_cell_executed,
        )
        skipped = [i for i in code_cells if i in skips]
        report.skipped = len(skipped)
        say(f"starting a kernel for {path.name} (graded against {solution_path.name}; "
            f"{len(code_cells) - len(skipped)} of {len(code_cells)} code cells run, the others cannot change "
            f"the score; {cell_timeout:g} s each at most" + (f", {memory_mb:g} MiB" if memory_mb else "") + ")")
        # The kernel's own stderr goes to a file (start-up chatter stays off the screen); what it
        # wrote after start-up, its last words, is reported if it dies.
        log_path = Path(work) / "kernel.log"
        kernel_log = stack.enter_context(open(log_path, "wb"))  # noqa: SIM115 - closed by the stack
        env = {**os.environ, course.AUTOGRADING_ENV: "1"}
        try:
            stack.enter_context(client.setup_kernel(env=env, stderr=kernel_log))
        except Exception as exc:  # noqa: BLE001 - no kernel spec, no ipykernel, a start-up timeout
            raise KernelStartError(f"could not start the Jupyter kernel {kernel!r}: {type(exc).__name__}: {exc}") from exc
        log_start = log_path.stat().st_size
        poll_in_slices(client.kc.shell_channel)
        poll_in_slices(client.kc.iopub_channel)
        pid = client.km.provisioner.pid if client.km.provisioner is not None else None
        watchdog = stack.enter_context(MemoryWatchdog(pid, memory_mb)) if memory_mb and pid else None

        for n, index in enumerate(code_cells, 1):
            cell = nb.cells[index]
            gid = _grade_id(cell)
            if index in skips:
                say(course.cell_line(n, len(code_cells), gid, None, "left out: " + skips[index]))
                continue
            t0 = time.perf_counter()
            try:
                client.execute_cell(cell, index)
            except DeadKernelError:
                if watchdog is not None and watchdog.tripped:
                    why = f"the kernel used {watchdog.tripped:.0f} MiB, over the {memory_mb:g} MiB limit"
                else:
                    last = log_path.read_bytes()[log_start:].decode(errors="replace").strip().splitlines()[-1:]
                    why = "the kernel died" + (f" ({_first_line(last[0])})" if last else "")
                report.stopped = f"{why} in cell {n} ({gid or f'cell {index}'})"
                say(course.cell_line(n, len(code_cells), gid, None, f"stopped: {why}"))
                break
            seconds = time.perf_counter() - t0
            reply = replies.get(index, {})
            status = "ok"
            if reply.get("status") == "error":
                status = "timed out" if reply.get("ename") == course.TIMEOUT_ERROR else "error"
            if gid in outcomes:
                o = outcomes[gid]
                o.seconds = seconds
                if status == "ok":
                    o.status, o.score, o.message = PASSED, o.points, ""
                elif status == "timed out":
                    o.status, o.message = TIMED_OUT, f"ran longer than the {cell_timeout:g} s limit"
                else:
                    o.status, o.message = FAILED, _error_message(reply)
                status = o.status
            say(course.cell_line(n, len(code_cells), gid, seconds, status))
    if report.stopped:
        for o in outcomes.values():
            if o.status == NOT_RUN and not o.message and not o.written:
                o.message = report.stopped
    report.seconds = time.perf_counter() - t_start
    return report


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def format_report(report: SelfGradeReport, width: int | None = None) -> str:
    """The per-exercise table ``llmu grade NOTEBOOK`` prints, with the total.

    A row gives an exercise's points and how it went (``passed``, ``failed``, ``timed out``, ...).
    Under an exercise that lost points comes the whole message of each check that failed (what
    broke, by how much, where to look), indented and wrapped to ``width`` columns (default: the
    terminal's width).
    """
    if width is None:
        width = shutil.get_terminal_size((100, 24)).columns
    width = max(int(width), 40)
    w_ex = max([len("exercise"), *(len(e.title) for e in report.exercises)])
    pts = [f"{e.score:g} / {e.max_score:g}" for e in report.exercises]
    w_pts = max([len("points"), *map(len, pts)])
    lines = [f"{'exercise':<{w_ex}}  {'points':>{w_pts}}  status"]
    for exercise, points in zip(report.exercises, pts):
        lost = next((c for c in exercise.cells if c.status != PASSED and not c.written), None)
        status = lost.status if lost else PASSED
        if exercise.written:
            status += f"; written answer ({exercise.written_points:g} points): graded by a person"
        lines.append(f"{exercise.title:<{w_ex}}  {points:>{w_pts}}  {status}")
        for message in exercise.messages:
            lines += _wrap_message(message, width, indent=" " * 4)
    total = f"{report.score:g} / {report.max_score:g}"
    lines.append(f"{'total':<{w_ex}}  {total:>{w_pts}}"
                 + (f"  auto-graded; {report.written_points:g} more points for written answers, "
                    "graded by a person" if report.written_points else ""))
    lines += _written_section(report, width)
    if report.stopped:
        lines.append("")
        lines += textwrap.wrap(f"The run stopped early: {report.stopped}.", width)
    notes = []
    if report.exercise is not None:
        notes.append(f"Exercise {report.exercise} only: its answers and tests ran, with the cells they need.")
    if report.skipped:
        notes.append(f"{report.skipped} cell(s) left out that cannot change the score "
                     + ("(not needed by this exercise)" if report.exercise is not None else
                        "(the instructor's cells that read nothing your answers bind)")
                     + "; --all-cells runs every cell, as a class's autograde does.")
    if notes:
        lines.append("")
        for note in notes:
            lines += textwrap.wrap(note, width)
    return "\n".join(lines)


def _written_section(report: SelfGradeReport, width: int) -> list[str]:
    """The written answers: whether each holds an answer, then the rubric a grader applies."""
    written = [(e, c) for e in report.exercises for c in e.written]
    if not written:
        return []
    lines = ["", *textwrap.wrap("Written answers are not graded by this command: in a class your instructor "
                                "grades them; studying alone, grade yours against the rubric below.", width)]
    for exercise, cell in written:
        if cell.status == WRITTEN:
            state = f"you wrote {cell.words} word{'s' if cell.words != 1 else ''}"
        elif cell.status == MISSING:
            state = cell.message
        else:
            state = f"not answered yet (the cell still says {course.TEXT_STUB!r})"
        lines.append("")
        lines += textwrap.wrap(f"Exercise {exercise.title}, {cell.grade_id} ({cell.points:g} points): {state}.", width)
        lines += _wrap_message(cell.rubric or "(the instructor notebook gives no rubric)", width, indent=" " * 4)
    return lines


def _wrap_message(message: str, width: int, indent: str) -> list[str]:
    """A message's lines wrapped to ``width``, each under ``indent`` plus its own indent, a wrapped
    line's continuation two spaces further in; words (paths, shapes) are never split."""
    out = []
    for line in message.splitlines():
        own = indent + line[:len(line) - len(line.lstrip())]
        out += textwrap.wrap(line.strip(), width, initial_indent=own, subsequent_indent=own + "  ",
                             break_long_words=False, break_on_hyphens=False) or [""]
    return out
