"""Kernel and benchmark code imports with torch, Triton, numpy and einops only.

A GPU image may lack the packages that the notebooks, the tokenizer and the model files need
(tokenizers, gguf, safetensors, plotly, ipywidgets, nbgrader, Jupyter, IPython, transformers), and
``benchmarks/gpu.sh`` must still run every kernel test and benchmark there. This test imports
every ``llmu.<topic>.kernels`` and ``llmu.<topic>.bench`` in a subprocess where those packages
raise ImportError, each module from a fresh start (a module that failed once must not hide behind
a half-imported parent left in ``sys.modules``), then loads the benchmark registry strictly and runs
``python -m llmu.bench --list --strict``.

The tests at the end read llmu's import statements (with ``ast``, importing nothing) and fail on
any import cycle: a module whose import, directly or through others, imports itself again runs with
the names below its own import line missing, and which module wins depends on which one a program
happens to import first. They check three graphs, from strict to broad:

- the imports that run when a module is imported (module level, ``if``/``try``/``with`` blocks and
  class bodies included; ``if TYPE_CHECKING:`` left out);
- every import, including those deferred into a function: a cycle closed by a deferred import
  imports fine but couples two modules both ways (a reference that imports its own kernels);
- every import, module by module folded into its package (``llmu.training``, ``llmu.scale``,
  ...): two topics that import each other cannot be read, or tested, one before the other.

An edge goes from a module to each llmu module its imports load: ``import llmu.a.b`` and ``from
llmu.a.b import name`` to ``llmu.a.b``; ``from llmu.a import b`` to ``llmu.a.b`` when ``b`` is a
submodule and to ``llmu.a`` (its ``__init__``) when it is a name; relative imports likewise. Importing
``llmu.a.b`` from outside ``llmu.a`` also runs ``llmu/a/__init__.py``: an edge to ``llmu.a`` too.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
import textwrap
from collections import deque
from pathlib import Path

import llmu

BLOCKED = ["tokenizers", "gguf", "plotly", "ipywidgets", "nbgrader", "jupyterlab", "jupyter",
           "jupyter_server", "jupyter_client", "notebook", "nbformat", "nbclient", "ipykernel",
           "IPython", "transformers", "accelerate", "safetensors", "psutil"]

BLOCKER = textwrap.dedent(f"""
    import importlib, importlib.abc, sys

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {set(BLOCKED)!r}:
                raise ImportError(f"{{name}} is blocked by the test", name=name)
            return None

    sys.meta_path.insert(0, Blocked())
""")

CHECK = BLOCKER + textwrap.dedent("""
    import runpy

    import llmu.bench
    from llmu.bench.registry import TOPICS

    def forget_llmu():
        for name in [n for n in sys.modules if n == "llmu" or n.startswith("llmu.")]:
            del sys.modules[name]

    imported, failed = [], []
    for topic in TOPICS:
        for part in ("kernels", "bench"):
            module = f"llmu.{topic}.{part}"
            forget_llmu()
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name != module:
                    failed.append(f"{module}: {exc!r}")
            except Exception as exc:
                failed.append(f"{module}: {exc!r}")
            else:
                imported.append(module)
    for module in failed:
        print("FAILED", module)
    forget_llmu()
    from llmu.bench.registry import load_all
    registry = load_all(strict=True)
    print("imported", len(imported), "entries", len(registry))
    sys.argv = ["python -m llmu.bench", "--list", "--strict"]
    try:
        runpy.run_module("llmu.bench", run_name="__main__")
    except SystemExit as exc:
        print("llmu.bench exit", exc.code)
    sys.exit(1 if failed else 0)
""")


def test_kernel_and_bench_modules_import_without_notebook_or_model_packages():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "FAILED" not in out
    assert "llmu.bench exit 0" in out, out
    imported = int(out.split("imported ")[1].split()[0])
    assert imported >= 20, out  # most topics have kernels and a bench module
    assert int(out.split("entries ")[1].split()[0]) >= 20, out


def test_the_blocker_blocks():
    """The check above would pass vacuously if the blocked names still imported."""
    code = BLOCKER + "import llmu.models.tokenizer\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "tokenizers is blocked by the test" in proc.stderr


# ---------------------------------------------------------------------------------------------
# Import cycles
# ---------------------------------------------------------------------------------------------

LLMU_ROOT = Path(llmu.__file__).parent


def llmu_modules(root: Path = LLMU_ROOT) -> dict[str, Path]:
    """Every module and package under ``root`` (the ``llmu`` package): ``{dotted name: source file}``.

    ``pkgutil.iter_modules`` lists a folder's modules without importing anything, so a package that
    needs a missing optional dependency still has its submodules listed (``walk_packages`` imports
    each package to find its children, and would silently skip those of one that fails)."""
    found = {"llmu": root / "__init__.py"}
    todo = [("llmu", root)]
    while todo:
        package, folder = todo.pop()
        for info in pkgutil.iter_modules([str(folder)]):
            name = f"{package}.{info.name}"
            if info.ispkg:
                found[name] = folder / info.name / "__init__.py"
                todo.append((name, folder / info.name))
            else:
                found[name] = folder / f"{info.name}.py"
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(body: list[ast.stmt], deferred: bool):
    """The import statements of ``body`` that run: those of the module's own code (and of the
    blocks, branches and class bodies it runs), or with ``deferred`` those of functions too."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _type_checking(node.test):
                yield from _imports(node.body, deferred)
            yield from _imports(node.orelse, deferred)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if deferred:
                yield from _imports(node.body, deferred)
        else:  # try/except/else/finally, with, for, while, class bodies: every nested statement list
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, None) or []:
                    if isinstance(child, ast.ExceptHandler):
                        yield from _imports(child.body, deferred)
                    elif isinstance(child, ast.stmt):
                        yield from _imports([child], deferred)


def import_graph(modules: dict[str, Path], deferred: bool = False) -> dict[str, dict[str, str]]:
    """``{module: {llmu module it imports: "file:line" of the import}}`` (see the module docstring)."""
    graph: dict[str, dict[str, str]] = {}
    root = modules["llmu"].parent
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = graph.setdefault(name, {})
        for node in _imports(tree.body, deferred):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:  # relative: level 1 is this module's package, 2 its parent, ...
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            where = f"{path.relative_to(root.parent)}:{node.lineno}"
            for target in targets:
                if target not in modules:
                    continue  # not llmu
                if target != name:
                    edges.setdefault(target, where)
                # and each package above it that is not already being imported (an ancestor of
                # this module is: Python imports a module's packages before the module itself)
                parts = target.split(".")
                for i in range(2, len(parts)):
                    above = ".".join(parts[:i])
                    if above != name and not name.startswith(above + "."):
                        edges.setdefault(above, where)
    return graph


def by_package(graph: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The same graph with each module folded into its top package (``llmu.moe.kernels`` into
    ``llmu.moe``; a module directly under ``llmu`` is its own node), edges within one dropped."""
    def top(name: str) -> str:
        return ".".join(name.split(".")[:2])
    folded: dict[str, dict[str, str]] = {}
    for source, edges in graph.items():
        out = folded.setdefault(top(source), {})
        for target, where in edges.items():
            if top(target) != top(source):
                out.setdefault(top(target), where)
    return folded


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One shortest cycle (``[a, b, ..., a]``) in each strongly connected part of ``graph`` that has
    more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        parts.append(sorted(part))
    found = []
    for part in parts:  # breadth-first from the part's first module back to itself, inside the part
        first, members = part[0], set(part)
        came_from: dict[str, str] = {}
        queue = deque([first])
        while queue:
            node = queue.popleft()
            if first in graph.get(node, {}):
                path = [node]
                while path[-1] != first:
                    path.append(came_from[path[-1]])
                found.append(path[::-1] + [first])
                break
            for child in sorted(graph.get(node, {})):
                if child in members and child not in came_from and child != first:
                    came_from[child] = node
                    queue.append(child)
    return found


def describe(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
    """``a -> b -> a`` and, for each arrow, where the import is."""
    lines = [" -> ".join(cycle)]
    lines += [f"    {a} imports {b} at {graph[a][b]}" for a, b in zip(cycle, cycle[1:])]
    return "\n".join(lines)


def _assert_acyclic(graph: dict[str, dict[str, str]], what: str) -> None:
    found = cycles(graph)
    assert not found, f"import cycles among llmu's {what}:\n" + "\n".join(describe(c, graph) for c in found)


def test_every_module_is_read():
    """The walk sees the whole package, subpackages and ``__init__`` files included."""
    modules = llmu_modules()
    for name in ("llmu", "llmu.runtime", "llmu.moe", "llmu.moe.kernels", "llmu.moe.layer", "llmu.bench.runner",
                 "llmu.models.config", "llmu.gpu_compile.__main__"):
        assert name in modules and modules[name].is_file(), name
    assert len(modules) > 150


def test_no_import_cycle_when_modules_are_imported():
    _assert_acyclic(import_graph(llmu_modules()), "modules (imports that run when a module is imported)")


def test_no_import_cycle_counting_imports_deferred_into_functions():
    _assert_acyclic(import_graph(llmu_modules(), deferred=True), "modules (deferred imports included)")


def test_no_import_cycle_between_packages():
    _assert_acyclic(by_package(import_graph(llmu_modules(), deferred=True)), "packages (deferred imports included)")


def _graph_of(tmp_path: Path, files: dict[str, str], deferred: bool = False) -> dict[str, dict[str, str]]:
    """The import graph of a made-up ``llmu`` package: ``{"moe/kernels.py": source, ...}``."""
    folder = tmp_path / str(len(list(tmp_path.iterdir()))) / "llmu"
    for rel, source in {"__init__.py": "", **files}.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(textwrap.dedent(source), encoding="utf-8")
    return import_graph(llmu_modules(folder), deferred)


def test_the_check_finds_each_kind_of_cycle(tmp_path):
    """The checks above would pass vacuously if the graph missed edges: each form of import that
    closes a cycle is found, and the forms that do not are not."""
    pkg = {"t/__init__.py": ""}
    # module level, one absolute and one relative import
    g = _graph_of(tmp_path, {**pkg, "t/a.py": "from llmu.t.b import x\n", "t/b.py": "from .a import y\n"})
    assert cycles(g) == [["llmu.t.a", "llmu.t.b", "llmu.t.a"]]
    # `from package import submodule` is an edge to the submodule; a name is an edge to __init__
    g = _graph_of(tmp_path, {"t/__init__.py": "from llmu.t.a import f\n", "t/a.py": "from llmu.t import b\n",
                             "t/b.py": "from llmu.t import helper\n"})
    assert cycles(g) == [["llmu.t", "llmu.t.a", "llmu.t.b", "llmu.t"]]
    # inside try/except and if (not TYPE_CHECKING); under TYPE_CHECKING it is no edge
    g = _graph_of(tmp_path, {**pkg, "t/a.py": "try:\n    import llmu.t.b\nexcept ImportError:\n    pass\n",
                             "t/b.py": "if True:\n    from llmu.t import a\n"})
    assert cycles(g)
    g = _graph_of(tmp_path, {**pkg, "t/a.py": "import llmu.t.b\n",
                             "t/b.py": "import typing\nif typing.TYPE_CHECKING:\n    from llmu.t import a\n"})
    assert not cycles(g)
    # an import inside a function counts only with deferred=True
    files = {**pkg, "t/reference.py": "def f():\n    from llmu.t.kernels import k\n",
             "t/kernels.py": "from llmu.t import reference\n"}
    assert not cycles(_graph_of(tmp_path, files)) and cycles(_graph_of(tmp_path, files, deferred=True))
    # importing llmu.y.n from outside llmu.y runs llmu/y/__init__.py first: an edge to llmu.y
    g = _graph_of(tmp_path, {"x/__init__.py": "from llmu.x.m import f\n", "x/m.py": "import llmu.y.n\n",
                             "y/__init__.py": "from llmu.y.o import g\n", "y/n.py": "",
                             "y/o.py": "from llmu.x import helper\n"})
    assert cycles(g) == [["llmu.x", "llmu.x.m", "llmu.y", "llmu.y.o", "llmu.x"]]
    # two packages whose modules import each other, with no module cycle, are a package cycle
    g = _graph_of(tmp_path, {"x/__init__.py": "", "x/m.py": "import llmu.y.n\n", "x/q.py": "",
                             "y/__init__.py": "", "y/n.py": "", "y/o.py": "from llmu.x.q import z\n"})
    assert not cycles(g) and cycles(by_package(g)) == [["llmu.x", "llmu.y", "llmu.x"]]
    # a module importing a sibling through their package is no cycle with that package
    g = _graph_of(tmp_path, {"t/__init__.py": "from llmu.t import a\n", "t/a.py": "from llmu.t import b\n",
                             "t/b.py": ""})
    assert not cycles(g)
