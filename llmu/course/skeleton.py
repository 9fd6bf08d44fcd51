"""The structure every course notebook shares (checked by tests/course/test_skeleton.py)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .colab import colab_cell_source
from .links import CODE_LINK, code_links_source, github_url
from .notebooks import is_grade, is_test, is_written, nbgrader_meta, rubric_of, rubric_points, solution_region
from .paths import CourseError

#: The markdown cells that close every notebook, in this order: grade_id and heading.
CLOSING_CELLS = (("summary", "## Summary"), ("self_check", "## Self-check"),
                 ("code_links", "## The code behind this notebook"))

#: An exercise heading, "### Exercise 2 · Title (2 + 3 points)". The points are optional to match
#: (self-grading groups cells under any such heading); the skeleton check requires them.
EXERCISE_HEADING = re.compile(
    r"^\s*#{1,6}\s*Exercise\s+(?P<number>\d+)\s*[·:.\-–—]?\s*(?P<title>.*?)\s*"
    r"(?:\((?P<points>[\d +]+) points?\))?\s*$",
    re.IGNORECASE,
)
def exercise_groups(cells) -> list[tuple[re.Match | None, list]]:
    """A notebook's graded cells (test cells and written answers) grouped by the exercise heading
    above them, in notebook order: ``[(heading match, [cells]), ...]``, each match of
    :data:`EXERCISE_HEADING` (its ``number``, ``title`` and ``points``). Graded cells before the
    first heading come first, under ``None``. A heading with no graded cell under it keeps an
    empty list. ``cells`` are a
    notebook's cells (nbformat nodes or plain dictionaries)."""
    groups: list[tuple[re.Match | None, list]] = [(None, [])]
    for cell in cells:
        if cell["cell_type"] == "markdown":
            source = "".join(cell["source"])
            groups += [(m, []) for m in filter(None, map(EXERCISE_HEADING.match, source.splitlines()))]
        if is_test(cell) or is_written(cell):
            groups[-1][1].append(cell)
    return groups if groups[0][1] else groups[1:]


_LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")


def skeleton_problems(path) -> list[str]:
    """What a course notebook lacks of the shared skeleton; ``[]`` when it has all of it.

    The skeleton: cell 0 is the ``colab`` cell (:func:`colab_cell_source`); then the ``intro``
    markdown (a ``# NN · Title`` heading and a **Learning goals** list) and the ``setup`` code
    cell; numbered sections; exercises headed ``Exercise N · Title (a + b points)`` with N = 1, 2,
    ... and a + b equal to the points of the graded test cells under the heading; and, last, the
    markdown cells of :data:`CLOSING_CELLS`: a summary, a self-check with answers, and links to
    the llmu files the notebook used (each must open the file from the notebook, and its GitHub
    twin the same file on GitHub; see :mod:`llmu.course.links`).
    """
    path = Path(path)
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = nb["cells"]
    ids = [nbgrader_meta(c).get("grade_id") for c in cells]
    src = ["".join(c["source"]) for c in cells]
    problems: list[str] = []
    # -- the first cells
    if not cells or ids[0] != "colab" or cells[0]["cell_type"] != "code":
        problems.append("cell 0 must be the code cell with grade_id 'colab'")
    elif src[0] != colab_cell_source():
        problems.append("cell 0 ('colab') differs from llmu.course.colab_cell_source(); regenerate it")
    if ids[1:3] != ["intro", "setup"]:
        problems.append(f"cells 1 and 2 must be 'intro' and 'setup', found {ids[1:3]}")
    else:
        intro = src[1]
        number = path.stem.split("_", 1)[0]
        if not re.match(rf"# {re.escape(number)} · \S", intro):
            problems.append(f"the intro must start with '# {number} · Title'")
        goals = re.search(r"^\*\*Learning goals\*\*\s*\n((?:\s*\n)?(?:- .+\n?(?:  .+\n?)*)+)", intro, re.M)
        if not goals or len(re.findall(r"^- ", goals.group(1), re.M)) < 3:
            problems.append("the intro needs a '**Learning goals**' line followed by at least 3 bullet points")
        if not src[2].lstrip().startswith("import llmu"):
            problems.append("the setup cell must start with 'import llmu'")
    # -- sections
    body = [s for s, c in zip(src, cells) if c["cell_type"] == "markdown"]
    sections = [line for s in body for line in s.splitlines() if line.startswith("## ")]
    if len(sections) < 2 + len(CLOSING_CELLS):
        problems.append(f"expected at least two '## ' sections before the closing cells, found {sections}")
    # -- exercises: numbering, and points in the heading against the graded cells under it
    exercises: list[tuple[int, int, int]] = []  # (number, points in the heading, points of the cells)
    for m, graded in exercise_groups(cells):
        if m is None:
            continue
        if m["points"] is None:
            problems.append(f"exercise {m['number']}: the heading must end with its points, '(a + b points)'")
            continue
        stated = sum(int(p) for p in m["points"].split("+"))
        exercises.append((int(m["number"]), stated, sum(int(nbgrader_meta(c).get("points", 0)) for c in graded)))
    graded_points = sum(int(nbgrader_meta(c).get("points", 0)) for c in cells if is_grade(c))
    if graded_points and not exercises:
        problems.append("graded cells but no 'Exercise N · Title (a + b points)' heading")
    numbers = [n for n, _, _ in exercises]
    if numbers != list(range(1, len(numbers) + 1)):
        problems.append(f"exercises must be numbered 1, 2, ... in order, found {numbers}")
    for n, stated, got in exercises:
        if stated != got:
            problems.append(f"exercise {n}: the heading says {stated} points, its graded cells give {got}")
    if sum(got for _, _, got in exercises) != graded_points:
        problems.append("some graded cells come before the first exercise heading")
    # -- written answers: the question stays in the student copy, the rubric's points add up
    for cell, gid, text in zip(cells, ids, src):
        if not is_written(cell):
            continue
        region = solution_region(text)
        if region is None or not region[0].strip():
            problems.append(f"written answer {gid!r}: the question must stand before '### BEGIN SOLUTION' "
                            "(the student copy keeps it; the region holds the model answer and the rubric)")
            continue
        items = rubric_points(rubric_of(text))
        if not items:
            problems.append(f"written answer {gid!r}: its solution region needs a '**Rubric**' line followed by "
                            "items '- **N points** what earns them'")
        elif sum(p for p, _ in items) != nbgrader_meta(cell).get("points"):
            problems.append(f"written answer {gid!r}: the rubric gives {sum(p for p, _ in items):g} points, "
                            f"the cell is worth {nbgrader_meta(cell).get('points')}")
    # -- the closing cells
    want = [gid for gid, _ in CLOSING_CELLS]
    if ids[-len(want):] != want:
        problems.append(f"the last cells must be {want}, found {ids[-len(want):]}")
    else:
        for (gid, heading), s in zip(CLOSING_CELLS, src[-len(want):]):
            if not s.startswith(heading + "\n"):
                problems.append(f"cell {gid!r} must start with '{heading}'")
        checks = src[-2]
        if not re.search(r"^1\. ", src[-2], re.M) or "<details>" not in checks:
            problems.append("the self-check needs numbered questions and <details> with the answers")
        if src[-1] != code_links_source(path):
            problems.append("'code_links' differs from llmu.course.code_links_source(); "
                            "run llmu.course.apply_skeleton(path) after changing the imports")
        problems += _code_link_problems(path, src[-1])
    return problems


def _code_link_problems(path: Path, source: str) -> list[str]:
    """The ``code_links`` cell's links, read back: every link is one of a pair (:data:`CODE_LINK`)
    whose relative link reaches an llmu file from the notebook, whose text is that file's path
    from the checkout's root (in backticks), and whose GitHub link shows the same file."""
    problems = []
    pairs = list(CODE_LINK.finditer(source))
    if not pairs:
        problems.append("'code_links' has no links to llmu files")
    paired = {m["relative"] for m in pairs} | {m["github"] for m in pairs}
    for link in _LINK.findall(source):
        if link not in paired:
            problems.append(f"'code_links' links to {link} on its own; each file needs "
                            "[`llmu/x.py`](../../llmu/x.py) ([GitHub](...)), as code_link() writes")
    for m in pairs:
        shown, link = m["shown"], m["relative"]
        # Paths as the links spell them (a link into a symlinked folder is still a link into it).
        target = Path(os.path.normpath(path.absolute().parent / link))
        root = Path(os.path.normpath(path.absolute().parents[2]))  # notebooks lie two folders down
        if "://" in link or not target.is_file():
            problems.append(f"'code_links' links to {link}, which is not a file of the repository")
            continue
        if not target.is_relative_to(root / "llmu"):
            problems.append(f"'code_links' links to {link}, which is not llmu code")
            continue
        relative = target.relative_to(root).as_posix()
        if shown != relative:
            problems.append(f"'code_links' shows `{shown}` for {link}, which is {relative}")
        if m["github"] != github_url(relative):
            problems.append(f"'code_links': the GitHub link of {relative} is {m['github']}, "
                            f"expected {github_url(relative)}")
    return problems


def apply_skeleton(path) -> bool:
    """Rewrite the generated cells of a notebook: cell 0 (``colab``) and the last (``code_links``).

    Both cells must exist already (with their grade_ids): this only refreshes their source, so an
    author runs it after changing a notebook's imports. Returns whether the file changed.
    """
    import nbformat

    path = Path(path)
    nb = nbformat.read(str(path), as_version=4)
    if not nb.cells or nbgrader_meta(nb.cells[0]).get("grade_id") != "colab" \
            or nbgrader_meta(nb.cells[-1]).get("grade_id") != "code_links":
        raise CourseError(f"{path}: the first cell must have grade_id 'colab' and the last 'code_links' "
                          "(see llmu.course.skeleton_problems)")
    before = (nb.cells[0].source, nb.cells[-1].source)
    nb.cells[0].source = colab_cell_source()
    nb.cells[-1].source = code_links_source(path)
    if (nb.cells[0].source, nb.cells[-1].source) == before:
        return False
    nbformat.write(nb, str(path))
    return True
