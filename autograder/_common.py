"""What the instructor scripts of this folder share: the Python they run with, the course root,
its nbgrader API, and the check that keeps hidden tests out of feedback pages.

Each script (``release``, ``collect``, ``autograde``, ``feedback``, ``export``) is a thin command
line around :mod:`llmu.course`, whose :func:`llmu.course.nbgrader_config` holds every nbgrader
setting; see README.md in this folder.
"""

from __future__ import annotations

import argparse
import html
import keyword
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent
#: What the scripts import; ``make setup`` installs it into the checkout's ``.venv``.
NEEDS = ("nbgrader", "torch")
#: Set when a script has started again with the checkout's Python (so that it never loops).
_SWITCHED = "LLMU_SCRIPT_PYTHON"


def use_checkout_python() -> None:
    """Run the script with the checkout's own Python, whatever ``python3`` comes first on PATH.

    The scripts start with ``#!/usr/bin/env python3``. Outside an activated virtual environment
    that is the system's Python, which has neither nbgrader nor torch. So when the checkout has
    the ``.venv`` that ``make setup`` builds and another Python runs the script, the script starts
    again with ``.venv/bin/python`` (same arguments, same process). Without a ``.venv``, the Python
    that runs it must have the packages; if it lacks one, the script stops and says to run
    ``make setup``.
    """
    venv = CHECKOUT / ".venv"
    python = venv / "bin" / "python"
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    if script is None or script.parent != HERE:  # imported (by a test), not run as a script
        return
    in_venv = Path(sys.prefix).resolve() == venv.resolve()
    if python.is_file() and not in_venv and not os.environ.get(_SWITCHED):
        os.environ[_SWITCHED] = str(python)
        os.execv(str(python), [str(python), str(script), *sys.argv[1:]])

    import importlib.util

    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        what = " and ".join(missing) + (" is" if len(missing) == 1 else " are")
        where = (f"the checkout's {python} lacks {'it' if len(missing) == 1 else 'them'} too" if python.is_file()
                 else f"the checkout has no .venv ({venv} does not exist)")
        raise SystemExit(
            f"autograder/{script.name}: {what} not installed for {sys.executable}, and {where}.\n"
            f"Run `make setup` in {CHECKOUT} (it builds .venv with nbgrader and the course's packages), "
            f"then run autograder/{script.name} again.")


use_checkout_python()

if str(CHECKOUT) not in sys.path:  # works from a plain checkout too, before `pip install -e .`
    sys.path.insert(0, str(CHECKOUT))

from llmu import course  # noqa: E402


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"autograder/{prog}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=None, metavar="DIR",
                   help="the course root, which holds solutions/, course/ and autograder/ (default: "
                        "$LLMU_COURSE_ROOT, else the checkout this script is in)")
    return p


def course_root(args) -> Path:
    if args.root is not None:
        root = Path(args.root).resolve()
        if not root.is_dir():
            raise SystemExit(f"--root: {args.root} is not a folder")
        return root
    env = os.environ.get("LLMU_COURSE_ROOT")
    return Path(env).resolve() if env else CHECKOUT


def known_assignment(root: Path, assignment: str) -> str:
    known = course.list_assignments(root)
    if assignment not in known:
        raise SystemExit(f"no assignment {assignment!r} in {course.solutions_dir(root)}; known: {', '.join(known) or 'none'}")
    return assignment


def api(root: Path):
    """nbgrader's API for the course at ``root``, configured by :func:`llmu.course.nbgrader_config`."""
    return course._api(course.nbgrader_config(root))


def feedback_dir(root: Path) -> Path:
    """Where nbgrader writes the feedback pages: ``autograder/feedback_html/<student>/<assignment>/``."""
    config = course.nbgrader_config(root)
    return Path(config.CourseDirectory.root) / config.CourseDirectory.feedback_directory


# ---------------------------------------------------------------------------------------------
# The leak check: no line that only a hidden test holds may appear on a feedback page
# ---------------------------------------------------------------------------------------------

#: A line of a hidden test counts only with at least this many characters and a name or a literal
#: in it: ``try:``, ``else:``, ``]:`` or ``pass`` tell nothing about the tests, and any page may
#: hold them.
MIN_LINE_CHARS = 8


def _split_hidden(source: str) -> tuple[list[str], list[str]]:
    """A cell's lines between the hidden-test markers (stripped), and its lines outside them."""
    hidden, outside, inside = [], [], False
    for line in source.splitlines():
        s = line.strip()
        if s == course.BEGIN_HIDDEN:
            inside = True
        elif s == course.END_HIDDEN:
            inside = False
        elif inside:
            hidden.append(s)
        else:
            outside.append(line)
    return hidden, outside


def telling(line: str) -> bool:
    """Whether a hidden-test line says something of its own: long enough, not a comment, and with
    a name (not a keyword) or a literal in it."""
    if len(line) < MIN_LINE_CHARS or line.startswith("#"):
        return False
    names = [w for w in re.findall(r"[A-Za-z_]\w*", line) if not keyword.iskeyword(w)]
    return bool(names) or bool(re.search(r"[0-9'\"]", line))


def shows(text: str, line: str) -> bool:
    """Whether ``text`` holds ``line``, not as a piece of a longer name or number (``x = 1`` is
    not in ``max = 10``). A traceback's ``----> 3 line`` holds it."""
    before = r"(?<!\w)" if re.match(r"\w", line) else ""
    after = r"(?!\w)" if re.search(r"\w$", line) else ""
    return re.search(before + re.escape(line) + after, text) is not None


def notebook_text(paths, *, learner_only: bool = False) -> str:
    """The source of every cell of the notebooks at ``paths``, joined. ``learner_only``: only the
    cells a learner writes (answers and cells of their own), not the locked cells that
    autograding puts back from the gradebook."""
    import nbformat

    parts = []
    for path in paths:
        for cell in nbformat.read(str(path), as_version=4).cells:
            meta = course.nbgrader_meta(cell)
            if learner_only and (meta.get("locked") or (meta.get("grade") and not meta.get("solution"))):
                continue
            parts.append(cell.source)
    return "\n".join(parts)


def hidden_test_lines(root: Path, assignment: str) -> set[str]:
    """The lines that only the hidden tests of ``assignment`` hold: what no feedback page may show.

    A line between the hidden-test markers of ``solutions/<assignment>/*.ipynb`` counts when it is
    :func:`telling` and does not occur (:func:`shows`) anywhere a learner sees anyway: outside the
    hidden regions of the instructor notebooks (text, solutions, visible tests) or in the released
    notebooks ``course/<assignment>/*.ipynb``. A ``check_close(...)`` line that stands in the
    visible test as well is no secret, and a page that shows it is fine.
    """
    import nbformat

    hidden, outside = set(), []
    for path in sorted((course.solutions_dir(root) / assignment).glob("*.ipynb")):
        for cell in nbformat.read(str(path), as_version=4).cells:
            h, o = _split_hidden(cell.source)
            hidden.update(h)
            outside += o
    released = sorted((course.course_dir(root) / assignment).glob("*.ipynb"))
    seen = "\n".join(outside) + "\n" + notebook_text(released)
    return {line for line in hidden if telling(line) and not shows(seen, line)}


def visible_text(page: str) -> str:
    """An HTML page's text: tags removed, entities decoded, the content of <script> kept (a page
    can carry notebook data there), so that a leak check sees everything a reader could."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def leaked_lines(page: str, hidden: set[str]) -> list[str]:
    """The hidden-test lines that a rendered page shows."""
    text = visible_text(page)
    return sorted(line for line in hidden if shows(text, line))
