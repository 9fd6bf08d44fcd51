"""nbgrader configuration for the llmu course (read by the `nbgrader` command line and formgrader).

The settings themselves are made in `llmu.course.nbgrader_config()`, so that the command line
and `llmu release` / `llmu grade` (which call nbgrader's Python API) can never disagree.
Run nbgrader from this folder (`cd autograder && nbgrader ...`), see README.md.

Course root: the repository (this file's parent folder). Source notebooks: solutions/. Student
release: course/. Submissions, autograded copies, feedback pages (feedback_html/: not feedback/,
which is a script), exchange and gradebook.db: here.
Per-cell execution time limit: llmu.course.CELL_TIMEOUT, 150 s (interrupted, grading goes on).
"""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # works from a plain checkout too, before `pip install -e .`
    sys.path.insert(0, _ROOT)

from llmu.course import nbgrader_config  # noqa: E402

c = get_config()  # noqa: F821  (provided by traitlets when it loads this file)
c.merge(nbgrader_config(_ROOT))
