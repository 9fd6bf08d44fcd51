"""The last cell of every notebook: links to the llmu code the notebook imports.

Each file gets two links, because a notebook is read in three places:

* ``[`llmu/x/y.py`](../../llmu/x/y.py)``, relative to the notebook (which lies two folders down,
  in ``solutions/NN_x/`` or ``course/NN_x/``): it opens the file in a JupyterLab tab wherever
  JupyterLab serves the whole checkout, which ``llmu lab`` does (:func:`llmu.cli.lab_command`)
  and so does Binder;
* ``([GitHub](https://github.com/.../blob/main/llmu/x/y.py))``: on Colab, which opens the
  notebook alone from the repository, a relative link leads nowhere; this one shows the file in
  the published repository (:data:`~llmu.course.colab.REPOSITORY_URL`, branch
  :data:`~llmu.course.colab.PUBLISHED_BRANCH`).

The link text is the path in backticks, so that markdown shows ``__init__.py`` as it is (not
as a bold "init").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .colab import PUBLISHED_BRANCH, REPOSITORY_URL
from .notebooks import without_hidden_tests
from .paths import CourseError, repo_root

#: Shared helpers every notebook uses; listed after the module's own code in ``code_links``.
_HELPER_MODULES = ("llmu.grading", "llmu.checks", "llmu.viz", "llmu.bench", "llmu.runtime", "llmu.course",
                   "llmu.data", "llmu.distributed")
_FROM_IMPORT = re.compile(r"^\s*from\s+(llmu(?:\.[\w.]+)?)\s+import\s+(\([^)]*\)|[^\n#]+)", re.M)
_PLAIN_IMPORT = re.compile(r"^\s*import\s+(llmu\.[\w.]+)", re.M)


def _module_file(name: str) -> Path | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def _module_summary(path: Path) -> str:
    """The first sentence of a module's docstring, for the links list."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    first = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", first).replace("``", "`")  # reST roles to markdown
    return re.split(r"(?<=[.:;])\s", first, maxsplit=1)[0].rstrip(".:;")


def _defining_module(module: str, name: str) -> str:
    """Where ``name`` is defined, when ``module`` only re-exports it (a package's ``__init__``)."""
    import importlib
    import inspect

    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return module
    home = getattr(obj, "__module__", None) if inspect.isfunction(obj) or inspect.isclass(obj) else None
    return home if home and home.startswith(module + ".") else module


def llmu_imports(path) -> dict[str, list[str]]:
    """The llmu modules a notebook's code cells import, in order of first use, each with the names
    taken from it (``{}`` of names for ``import llmu.x`` or a submodule imported by name)."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    used: dict[str, list[str]] = {}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        # what the learner's copy holds: hidden tests (the own-work check's import) are left out
        source = without_hidden_tests("".join(cell["source"]))
        for m in _PLAIN_IMPORT.finditer(source):
            used.setdefault(m.group(1), [])
        for m in _FROM_IMPORT.finditer(source):
            module = m.group(1)
            names = [n.split(" as ")[0].strip() for n in m.group(2).strip("()").replace("\n", " ").split(",")]
            for name in filter(None, names):
                if _module_file(f"{module}.{name}") is not None:  # a submodule imported by name
                    used.setdefault(f"{module}.{name}", [])
                    continue
                names_of = used.setdefault(_defining_module(module, name), [])
                if name not in names_of:
                    names_of.append(name)
    used.pop("llmu", None)
    return used


def github_url(relative: str) -> str:
    """Where a file of the repository (``llmu/x/y.py``, relative to the checkout's root) is shown
    on GitHub, on the branch the course is published from."""
    return f"{REPOSITORY_URL}/blob/{PUBLISHED_BRANCH}/{relative}"


def code_link(relative: str) -> str:
    """The two links of one file: to open it in JupyterLab (from a notebook two folders down)
    and on GitHub. ``relative`` is its path from the checkout's root, ``/``-separated."""
    return f"[`{relative}`](../../{relative}) ([GitHub]({github_url(relative)}))"


#: One line of the links list, as :func:`code_link` writes it: the path shown, the relative link,
#: and the GitHub link (for checks that read a notebook's links back).
CODE_LINK = re.compile(r"\[`(?P<shown>[^`]+)`\]\((?P<relative>[^)\s]+)\) \(\[GitHub\]\((?P<github>[^)\s]+)\)\)")


def code_links_source(path) -> str:
    """The ``code_links`` cell of a notebook: a link to every llmu file its code imports, with
    the names it takes from each and the file's own one-line summary; the module's own code first,
    then the course's shared helpers."""
    path = Path(path)
    root = repo_root()
    rows, helpers = [], []
    for module, names in llmu_imports(path).items():
        file = _module_file(module)
        if file is None:
            raise CourseError(f"{path.name} imports {module}, which is not an llmu module")
        rel = file.resolve().relative_to(root).as_posix()
        what = ", ".join(f"`{n}`" for n in names)
        summary = _module_summary(file)
        line = f"- {code_link(rel)}" + (f": {what}" if what else "") + (f". {summary}" if summary else "")
        (helpers if module.startswith(_HELPER_MODULES) else rows).append(line)
    parts = ["## The code behind this notebook", "",
             "Every llmu file this notebook's code cells import, with what they take from it. Each is "
             "written to be read after the notebook, and its tests are under `tests/`. A file's name opens "
             "it here in JupyterLab (`llmu lab`, Binder); on Colab, follow its GitHub link."]
    parts += ["", *rows] if rows else []
    parts += ["", "The course's shared helpers:", "", *helpers] if helpers else []
    return "\n".join(parts)


