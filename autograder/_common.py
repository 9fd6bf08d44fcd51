"""What the instructor scripts of this folder share: the course root and its nbgrader API.

Each script (``release``, ``collect``, ``autograde``, ``feedback``, ``export``) is a thin command
line around :mod:`llmu.course`, whose :func:`llmu.course.nbgrader_config` holds every nbgrader
setting; see README.md in this folder.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # works from a plain checkout too, before `pip install -e .`
    sys.path.insert(0, str(HERE.parent))

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
    return Path(env).resolve() if env else HERE.parent


def known_assignment(root: Path, assignment: str) -> str:
    known = course.list_assignments(root)
    if assignment not in known:
        raise SystemExit(f"no assignment {assignment!r} in {course.solutions_dir(root)}; known: {', '.join(known) or 'none'}")
    return assignment


def api(root: Path):
    """nbgrader's API for the course at ``root``, configured by :func:`llmu.course.nbgrader_config`."""
    return course._api(course.nbgrader_config(root))


def hidden_test_lines(root: Path, assignment: str) -> set[str]:
    """Every line between the hidden-test markers of the assignment's instructor notebooks
    (stripped; blank lines and comments left out: a comment may say what runs, harmlessly)."""
    import nbformat

    lines = set()
    for path in sorted((course.solutions_dir(root) / assignment).glob("*.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        for cell in nb.cells:
            inside = False
            for line in cell.source.splitlines():
                s = line.strip()
                if s == course.BEGIN_HIDDEN:
                    inside = True
                elif s == course.END_HIDDEN:
                    inside = False
                elif inside and s and not s.startswith("#"):
                    lines.add(s)
    return lines


def visible_text(page: str) -> str:
    """An HTML page's text: tags removed, entities decoded, the content of <script> kept (a page
    can carry notebook data there), so that a leak check sees everything a reader could."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def leaked_lines(page: str, hidden: set[str]) -> list[str]:
    """The hidden-test lines that a rendered page shows."""
    text = visible_text(page)
    return sorted(line for line in hidden if line in text)
