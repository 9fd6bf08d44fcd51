"""The single place where nbgrader is configured, and the checked calls into its API."""

from __future__ import annotations

import os
from pathlib import Path

from .paths import (
    AUTOGRADER_DIR,
    BEGIN_HIDDEN,
    CELL_TIMEOUT,
    CODE_STUB,
    COURSE_ID,
    RELEASE_DIR,
    SOURCE_DIR,
    TEXT_STUB,
    CourseError,
    _nbgrader_failure,
    _root,
    gradebook_url,
)

#: The folder of autograder/ that receives the HTML feedback pages, one folder per student.
FEEDBACK_DIR = "feedback_html"
#: The kernel option that keeps ipykernel's own warnings off the grader's terminal.
KERNEL_QUIET = "--IPKernelApp.log_level=ERROR"


def nbgrader_config(root=None, *, timeout: int = CELL_TIMEOUT):
    """nbgrader's settings for the course rooted at ``root`` (a traitlets ``Config``).

    ``autograder/nbgrader_config.py`` merges exactly this, so the ``nbgrader`` command line, the
    formgrader and this module share one configuration.
    """
    _scripts_on_path()
    from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
    from nbgrader.preprocessors import ClearHiddenTests, GetGrades
    from traitlets.config import Config

    root = _root(root)
    ag = AUTOGRADER_DIR
    c = Config()
    c.CourseDirectory.course_id = COURSE_ID
    c.CourseDirectory.root = str(root)  # must be absolute
    c.CourseDirectory.source_directory = SOURCE_DIR
    c.CourseDirectory.release_directory = RELEASE_DIR
    c.CourseDirectory.submitted_directory = f"{ag}/submitted"
    c.CourseDirectory.autograded_directory = f"{ag}/autograded"
    # Not autograder/feedback: that is the script that makes the pages (autograder/feedback), and
    # nbgrader would try to write into it as a folder. No output folder here may share a name
    # with a file of autograder/ (tests/course/test_instructor_scripts.py checks).
    c.CourseDirectory.feedback_directory = f"{ag}/{FEEDBACK_DIR}"
    c.CourseDirectory.solution_directory = f"{ag}/solution"
    c.CourseDirectory.source_with_tests_directory = f"{ag}/source_with_tests"
    c.CourseDirectory.db_url = gradebook_url(root)
    # Without this nbgrader would use a system-wide exchange directory.
    c.Exchange.root = str(root / ag / "exchange")
    # Per CELL, for validate and autograde. A student's infinite loop costs this much per cell
    # that calls it; interrupting (rather than killing the kernel) lets grading go on.
    c.Execute.timeout = int(timeout)
    c.Execute.interrupt_on_timeout = True
    # Each kernel would print "Kernel is running over TCP without encryption" (a WARNING of
    # ipykernel, meaningless for a kernel on this machine) once per submission and notebook;
    # errors still show.
    c.Execute.extra_arguments = [KERNEL_QUIET]
    # A kernel client that cannot sleep through a finished cell's reply (llmu/kernel_client.py).
    c.AsyncKernelManager.client_class = "llmu.kernel_client.SlicedPollKernelClient"
    c.ClearSolutions.code_stub = {"python": CODE_STUB}
    c.ClearSolutions.text_stub = TEXT_STUB
    # Feedback: nbgrader's ClearHiddenTests strips the hidden tests' source, but a failing hidden
    # test's traceback still quotes its lines; HideHiddenTracebacks (first, while the markers are
    # still there to find) cuts those tracebacks down to the check's own message.
    # StaticOutputs: an output the HTML page cannot show (a plotly figure, which carries nothing
    # but plotly's JSON) gets a sentence that says what it is and where to see it; otherwise
    # nbconvert would drop it from the page with a UserWarning.
    c.GenerateFeedback.preprocessors = [GetGrades, hide_hidden_tracebacks(), ClearHiddenTests,
                                        static_outputs(), CSSHTMLHeaderPreprocessor]
    return c


_HIDE = []


def hide_hidden_tracebacks():
    """The feedback preprocessor class that keeps hidden tests out of error tracebacks.

    IPython's traceback quotes the source lines around the failing one, so a failed hidden test
    shows itself (and its neighbours) in the student's feedback even after ``ClearHiddenTests``.
    In a cell with hidden tests, each error keeps only its type and message: the message of an
    ``llmu.grading`` check says which property failed and what to look at, which is the feedback
    meant for the learner.
    """
    if _HIDE:
        return _HIDE[0]
    from nbgrader.preprocessors import NbGraderPreprocessor

    class HideHiddenTracebacks(NbGraderPreprocessor):
        def preprocess_cell(self, cell, resources, index):
            if cell.cell_type == "code" and BEGIN_HIDDEN in cell.source:
                for out in cell.get("outputs", []):
                    if out.get("output_type") == "error":
                        out["traceback"] = [
                            f"{out.get('ename', 'Error')}: {out.get('evalue', '')}",
                            "(traceback not shown: this cell holds tests that stay hidden after grading)",
                        ]
            return cell, resources

    HideHiddenTracebacks.__module__ = __name__
    _HIDE.append(HideHiddenTracebacks)
    return HideHiddenTracebacks


#: plotly's own mimetype: a figure as JSON, drawn by plotly.js in JupyterLab (the course's figures
#: carry nothing else; see :func:`static_outputs`).
PLOTLY_MIMETYPE = "application/vnd.plotly.v1+json"
#: Where an interactive figure stood on a feedback page, the sentence that stands there instead.
FIGURE_NOTE = "Interactive figure{title}: not drawn on this page; open the notebook in JupyterLab to see it."
#: The same for any other output an HTML page cannot show.
OUTPUT_NOTE = "Output of type {mimetypes}: not shown on this page; open the notebook in JupyterLab to see it."
_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
_STATIC = []


def _figure_title(figure) -> str:
    """A plotly figure's title as plain text (plotly's <br> and <sup> markup flattened), or ''."""
    import html
    import re

    title = ((figure or {}).get("layout") or {}).get("title")
    text = title.get("text") if isinstance(title, dict) else title
    if not isinstance(text, str):
        return ""
    text = re.sub(r"\s*<br\s*/?>\s*", " - ", text, flags=re.I)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", text)).split())


def output_note(data) -> str:
    """The sentence that replaces an output whose mimetypes an HTML page cannot show (``data``: the
    output's mimebundle): for a plotly figure it names the figure by its title."""
    if PLOTLY_MIMETYPE in data:
        title = _figure_title(data[PLOTLY_MIMETYPE])
        return FIGURE_NOTE.format(title=f' "{title}"' if title else "")
    return OUTPUT_NOTE.format(mimetypes=", ".join(sorted(data)))


def static_outputs():
    """The feedback preprocessor class that gives every output a form the HTML page can show.

    nbconvert's HTML exporter picks, for each display or result output, the first mimetype of its
    ``display_data_priority`` that the output carries (HTML, images, LaTeX, Markdown, plain text;
    a widget view only with the widget's saved state). A plotly figure, shown in a kernel without
    a browser (as autograding runs it), carries only ``application/vnd.plotly.v1+json``: none of
    these. nbconvert then leaves the output out of the page and warns ("Your element with
    mimetype(s) ... is not able to be represented"), once per page.

    A static picture of the figure would need kaleido and a Chromium, which the course does not
    install; plotly's own HTML needs plotly.js (fetched from the network, or 4.8 MB inlined into
    every page). So such an output is replaced, on the page only, by a sentence
    (:func:`output_note`) that says which figure stood there and where to see it. Outputs that
    carry a form the page shows (a figure saved with an image or HTML beside its JSON, a widget
    with a text fallback) are left as they are.
    """
    if _STATIC:
        return _STATIC[0]
    import html

    from nbgrader.preprocessors import NbGraderPreprocessor

    class StaticOutputs(NbGraderPreprocessor):
        def preprocess_cell(self, cell, resources, index):
            # The exporter that registers this preprocessor is its parent, and the HTML exporter
            # sets display_data_priority for both: what it can show is what this one keeps.
            shown = set(self.display_data_priority) - {_WIDGET_VIEW}
            for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
                data = out.get("data")
                if out.get("output_type") in ("display_data", "execute_result") and data and not shown & set(data):
                    note = output_note(data)
                    out["data"] = {"text/html": f'<p class="llmu-output-note"><em>{html.escape(note)}</em></p>',
                                   "text/plain": note}
            return cell, resources

    StaticOutputs.__module__ = __name__
    _STATIC.append(StaticOutputs)
    return StaticOutputs


def _scripts_on_path() -> None:
    """Put this interpreter's script folder on PATH.

    nbgrader runs ``alembic`` (its database migration tool) as a subprocess when it opens a
    gradebook. In a virtual environment that was not activated (``.venv/bin/python -m ...``, as
    ``make test`` does) that script is not on PATH, and every gradebook step fails with
    ``FileNotFoundError: 'alembic'``.
    """
    os.environ["PATH"] = path_with_scripts(os.environ.get("PATH", ""))


def path_with_scripts(path: str) -> str:
    """``path`` (a ``PATH`` value) with the folder of this interpreter's scripts first (``.venv/bin``
    in a ``make lab`` set-up), unless it is already on it."""
    import sys

    scripts = os.path.dirname(os.path.abspath(sys.executable))
    if scripts in path.split(os.pathsep):
        return path
    return scripts + (os.pathsep + path if path else "")


def _api(config):
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    _scripts_on_path()

    # The API checks the exchange folder on start and logs a CRITICAL line when it is missing,
    # although this course does not use it.
    Path(config.Exchange.root).mkdir(parents=True, exist_ok=True)
    return NbGraderAPI(CourseDirectory(config=config), config=config)


def _checked(result: dict, step: str) -> dict:
    if not result.get("success"):
        key, log = _nbgrader_failure(result)
        raise CourseError(f"nbgrader {step} failed: {key}", log)
    return result


