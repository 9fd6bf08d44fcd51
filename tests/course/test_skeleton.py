"""Every course notebook has the same skeleton (``llmu.course.skeleton_problems``).

The parametrization discovers the notebooks of ``solutions/`` at collection time, so a new
notebook is checked as soon as it exists. The checker itself is tested on broken copies of a real
notebook: each kind of mistake must be reported.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import nbformat
import pytest

from llmu import course
from llmu.models.gguf_file import MODEL_REQUIREMENT

ROOT = course.repo_root()
SOURCES = course.source_notebooks(ROOT)


@pytest.mark.parametrize("path", SOURCES, ids=[p.parent.name for p in SOURCES])
def test_notebook_has_the_skeleton(path):
    problems = course.skeleton_problems(path)
    assert problems == [], f"{path.parent.name}: " + "; ".join(problems)


@pytest.mark.parametrize("path", SOURCES, ids=[p.parent.name for p in SOURCES])
def test_release_keeps_the_first_and_last_cells(path):
    """The student copy opens with the same install cell and ends with the same links."""
    released = nbformat.read(str(course.released_twin(path, ROOT)), as_version=4)
    assert released.cells[0].source == course.colab_cell_source()
    assert released.cells[-1].source == course.code_links_source(path)


def test_the_first_cell_installs_what_the_makefile_pins():
    makefile = (ROOT / "Makefile").read_text()
    spec = re.search(r"^MODEL_SPEC\s*\?=\s*(\S+)", makefile, re.M).group(1)
    assert spec == MODEL_REQUIREMENT
    source = course.colab_cell_source()
    assert MODEL_REQUIREMENT in source and f"git+{course.REPOSITORY_URL}" in source
    compile(source, "colab", "exec")  # it is valid Python


def test_repository_url_matches_pyproject():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["urls"]["Repository"] == course.REPOSITORY_URL


def test_readme_links_every_notebook_to_colab():
    readme = (ROOT / "README.md").read_text()
    missing = [p.parent.name for p in SOURCES if course.colab_url(p.parent.name) not in readme]
    assert not missing, f"README.md has no Colab link for {missing}"
    assert course.binder_url() in readme


RELEASED = sorted(course.course_dir(ROOT).glob("*/*.ipynb"))


@pytest.mark.parametrize("path", RELEASED, ids=[p.parent.name for p in RELEASED])
def test_every_code_link_of_a_released_notebook_opens_its_file(path):
    """Each link of the last cell, followed from the notebook's folder as JupyterLab follows it
    (``llmu lab`` and Binder serve the checkout), reaches a file of llmu/; its text is that path
    in backticks (so ``__init__.py`` shows as it is) and its GitHub twin shows the same path."""
    import os

    from llmu.course.links import CODE_LINK

    source = nbformat.read(str(path), as_version=4).cells[-1].source
    pairs = list(CODE_LINK.finditer(source))
    assert pairs, f"{path.parent.name}: no code links"
    assert 2 * len(pairs) == len(re.findall(r"\]\(", source)), "a link without its twin"
    for m in pairs:
        target = Path(os.path.normpath(path.parent / m["relative"]))
        assert target.is_file(), f"{m['relative']} does not open a file from {path.parent}"
        relative = target.relative_to(ROOT).as_posix()
        assert relative.startswith("llmu/") and m["shown"] == relative, (m["shown"], relative)
        assert m["github"] == f"{course.REPOSITORY_URL}/blob/{course.PUBLISHED_BRANCH}/{relative}"


def test_links_point_at_the_released_notebooks():
    assert course.colab_url("06_kv_cache").endswith("/blob/main/course/06_kv_cache/06_kv_cache.ipynb")
    assert course.binder_url("06_kv_cache").endswith("?urlpath=lab/tree/course/06_kv_cache/06_kv_cache.ipynb")


# -- the checker catches each kind of mistake -------------------------------------------------

REFERENCE = ROOT / "solutions" / "11_speculative_decoding" / "11_speculative_decoding.ipynb"


def _cell(nb, grade_id):
    return next(c for c in nb.cells if course.nbgrader_meta(c).get("grade_id") == grade_id)


def _broken(tmp_path, edit):
    """A copy of a real notebook with ``edit`` applied, two folders below a directory that links
    to llmu/, as in the repository, so that its relative links resolve the same way."""
    (tmp_path / "llmu").symlink_to(ROOT / "llmu", target_is_directory=True)
    folder = tmp_path / "solutions" / REFERENCE.parent.name
    folder.mkdir(parents=True)
    nb = nbformat.read(str(REFERENCE), as_version=4)
    edit(nb)
    path = folder / REFERENCE.name
    nbformat.write(nb, str(path))
    return path


@pytest.fixture
def problems_of(tmp_path):
    return lambda edit: course.skeleton_problems(_broken(tmp_path, edit))


def test_reference_copy_is_clean(problems_of):
    assert problems_of(lambda nb: None) == []


def _heading_points(nb):
    for c in nb.cells:
        if c.cell_type == "markdown" and "### Exercise 2 ·" in c.source:
            c.source = re.sub(r"\(\d+ \+ \d+ points\)", "(2 + 5 points)", c.source, count=1)


def _renumber(nb):
    for c in nb.cells:
        if c.cell_type == "markdown" and "### Exercise 3 ·" in c.source:
            c.source = c.source.replace("### Exercise 3 ·", "### Exercise 4 ·")


def _goals(nb):
    _cell(nb, "intro").source = _cell(nb, "intro").source.split("**Learning goals**")[0]


def _colab(nb):
    _cell(nb, "colab").source = "import llmu"


def _link(nb):
    _cell(nb, "code_links").source += "\n- [gone](../../llmu/no_such_file.py)"


def _lone_link(nb):
    """A link in the old form: relative only, and the path's underscores read as markdown."""
    cell = _cell(nb, "code_links")
    cell.source = re.sub(r"\[`(llmu/[^`]+)`\]\(([^)]+)\) \(\[GitHub\]\([^)]+\)\)", r"[\1](\2)", cell.source, count=1)


def _github_elsewhere(nb):
    cell = _cell(nb, "code_links")
    cell.source = re.sub(r"(\[GitHub\]\(https://[^)]+/blob/main/)llmu/[^)]+\)", r"\1llmu/runtime.py)", cell.source,
                         count=1)


def _shown_elsewhere(nb):
    cell = _cell(nb, "code_links")
    cell.source = re.sub(r"\[`llmu/[^`]+`\]", "[`llmu/runtime.py`]", cell.source, count=1)


def _order(nb):
    nb.cells[-1], nb.cells[-2] = nb.cells[-2], nb.cells[-1]


def _answers(nb):
    cell = _cell(nb, "self_check")
    cell.source = cell.source.split("<details>")[0]


@pytest.mark.parametrize("edit, expected", [
    (_heading_points, "exercise 2: the heading says 7 points"),
    (_renumber, "numbered 1, 2, ... in order"),
    (_goals, "Learning goals"),
    (_colab, "cell 0 ('colab') differs"),
    (_link, "no_such_file.py"),
    (_lone_link, "on its own"),
    (_github_elsewhere, "the GitHub link of"),
    (_shown_elsewhere, "shows `llmu/runtime.py`"),
    (_order, "the last cells must be"),
    (_answers, "<details>"),
], ids=["points", "numbering", "goals", "colab", "link", "lone-link", "github-elsewhere", "shown-elsewhere",
        "order", "answers"])
def test_checker_reports(problems_of, edit, expected):
    problems = problems_of(edit)
    assert any(expected in p for p in problems), problems


def test_code_links_follow_the_imports(tmp_path):
    nb = nbformat.read(str(REFERENCE), as_version=4)
    nb.cells[2].source += "\nfrom llmu.paged.block_manager import BlockManager"
    folder = tmp_path / "a" / "b"
    folder.mkdir(parents=True)
    path = folder / "x.ipynb"
    nbformat.write(nb, str(path))
    assert "BlockManager" not in nb.cells[-1].source
    assert "`BlockManager`" in course.code_links_source(path)
    assert "llmu/paged/block_manager.py" in course.code_links_source(path)
    assert course.apply_skeleton(path) is True
    assert course.apply_skeleton(path) is False
    assert "`BlockManager`" in nbformat.read(str(path), as_version=4).cells[-1].source


def _readme_rows() -> dict[str, list[str]]:
    readme = (ROOT / "README.md").read_text()
    rows = {}
    for line in readme.splitlines():
        m = re.match(r"\| `(\d\d_\w+)` \|(.*)", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split(" | ")]
    return rows


def test_readme_credits_the_learner_with_what_the_learner_writes():
    """The README's "what you write" column names a Triton kernel exactly for the notebooks whose
    graded solutions include one; what the learner only reads (llmu's kernels) goes in the next column."""
    rows = _readme_rows()
    assert sorted(rows) == sorted(p.parent.name for p in SOURCES), "one README row per notebook"
    for p in SOURCES:
        nb = json.loads(p.read_text())
        writes_kernel = any(course.is_solution(c) and "@triton.jit" in "".join(c["source"]) for c in nb["cells"])
        written = rows[p.parent.name][0]
        mentions = "triton" in written.lower() and "kernel" in written.lower()
        assert mentions == writes_kernel, (
            f"README, {p.parent.name}: 'what you write' = {written!r}, but the learner "
            f"{'writes' if writes_kernel else 'writes no'} Triton kernel there")
