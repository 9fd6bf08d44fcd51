"""A notebook cell that is also a ``.py`` file: the ``%%module NAME`` cell magic.

Code that runs on other processes (``llmu.distributed.launch``) must live in a module that those
processes can import: a function typed into a notebook cell exists only in the kernel. A cell that
starts with ::

    %%module my_dp
    import torch.distributed as dist

    def all_reduce_gradients(model):
        ...

is written to ``my_dp.py`` in the notebook's folder, imported from there as the module ``my_dp``
(again each time the cell runs, so an edit takes effect), and its public names (``__all__``, or
every name without a leading underscore that is not a module) are bound in the notebook, with the module itself as
``my_dp``. A function of it has ``__module__ == "my_dp"`` and a file behind it, so ``launch``
can start it on new processes, and a grader imports the same file.

The file is the cell's copy, not a place to edit: it starts with :data:`HEADER`, and it is
rewritten each time the cell runs. A file of that name without the header is someone's own work:
:func:`write_module` refuses to overwrite it, and says so. A name that an installed module already
has (``torch``, ``math``) is refused too: the import would find one or the other depending on the
folder it runs from.

Call :func:`register` once in a notebook (the course's setup cells do) to make the magic
available; outside IPython it does nothing. ``%load_ext llmu.cell_module`` does the same.
:func:`module_cell` and :func:`python_of` let tools that read notebooks without a kernel (the
course's tests and its cell-dependency analysis) treat such a cell as the Python it stands for.
"""

from __future__ import annotations

import importlib.util
import keyword
import os
import re
import sys
import tempfile
import types
from pathlib import Path

__all__ = ["HEADER", "MAGIC", "write_module", "module_cell", "python_of", "run_module_cell", "register",
           "written_by_magic"]

#: The cell magic's name: a cell starting with ``%%module NAME``.
MAGIC = "module"

#: The first line of every file :func:`write_module` writes; a file without it is never overwritten.
HEADER = ("# Written by the %%module cell magic from a notebook cell; edit the cell, not this file: "
          "it is rewritten each time the cell runs.")

_MARK = "__llmu_cell_module__"     # set on the modules this magic imported

_FIRST_LINE = re.compile(rf"^%%{MAGIC}(?:[ \t]+(?P<args>[^\n]*))?[ \t]*(?:\n|$)")


def written_by_magic(path: str | os.PathLike) -> bool:
    """Whether the file at ``path`` is one that :func:`write_module` wrote (it starts with :data:`HEADER`)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().rstrip("\n") == HEADER
    except (OSError, UnicodeDecodeError):
        return False


def _check_name(name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (the module's name), got {type(name).__name__}")
    if not name.isidentifier() or keyword.iskeyword(name) or not name.isascii():
        raise ValueError(f"name must be a Python identifier such as my_dp (it becomes the file name.py and "
                         f"the module's name), got {name!r}")
    return name


def _taken_by_another(name: str, path: Path) -> str | None:
    """Where an installed or already imported module of that name lives, if it is not one of this
    magic's (this cell's file, or another %%module file of that name: a notebook run elsewhere)."""
    existing = sys.modules.get(name)
    if existing is not None:
        if getattr(existing, _MARK, False):
            return None
        where = getattr(existing, "__file__", None)
    else:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return None
        where = spec.origin
    if where is not None and (Path(where).resolve() == path.resolve() or written_by_magic(where)):
        return None
    return where or "a built-in module"


def write_module(name: str, source: str, directory: str | os.PathLike | None = None) -> types.ModuleType:
    """Write ``source`` to ``directory/name.py`` (default: the current folder) and import it.

    The file starts with :data:`HEADER`. Returns the freshly imported module, which replaces any
    earlier one of that name in ``sys.modules``. Raises ``ValueError`` for a name that is not an
    identifier or that another module already has, ``FileExistsError`` when ``name.py`` exists and
    was not written here (it is left as it was), and whatever the code raises when it runs.
    """
    name = _check_name(name)
    if not isinstance(source, str):
        raise TypeError(f"source must be a str (the module's code), got {type(source).__name__}")
    folder = Path(directory if directory is not None else os.getcwd())
    if not folder.is_dir():
        raise ValueError(f"directory must be an existing folder, got {str(folder)!r}")
    path = folder / f"{name}.py"
    other = _taken_by_another(name, path)
    if other is not None:
        raise ValueError(f"name {name!r} is taken by another module ({other}); choose another name, "
                         f"such as my_{name}")
    if path.exists() and not written_by_magic(path):
        raise FileExistsError(f"{path} exists and was not written by %%{MAGIC}: it may be your own work, so it "
                              f"is left as it is. Rename or move it, or give the cell another module name.")
    text = f"{HEADER}\n{source}" + ("" if source.endswith("\n") else "\n")
    # write then rename: a reader (another process importing it) never sees half a file
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".py.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    importlib.invalidate_caches()
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    setattr(module, _MARK, True)
    previous = sys.modules.get(name)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        # the module stays what it was before this cell ran (or absent)
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
        raise
    return module


def module_cell(source: str) -> tuple[str, str] | None:
    """``(name, body)`` of a ``%%module NAME`` cell's source, or None for any other cell.

    Raises ``ValueError`` for a ``%%module`` line without exactly one name after it."""
    m = _FIRST_LINE.match(source.lstrip("\n"))
    if m is None:
        return None
    args = (m.group("args") or "").split()
    if len(args) != 1:
        raise ValueError(f"%%{MAGIC} takes one argument, the module's name (%%{MAGIC} my_dp), got "
                         f"{' '.join(args)!r}")
    return args[0], source.lstrip("\n")[m.end():]


def python_of(source: str) -> str:
    """The Python a cell stands for: a ``%%module NAME`` cell is its body followed by ``import NAME``
    (what it binds in the notebook); any other cell is returned as it is."""
    cell = module_cell(source)
    if cell is None:
        return source
    name, body = cell
    return f"{body}\nimport {name}\n"


def _public(module: types.ModuleType) -> dict:
    names = getattr(module, "__all__", None)
    if names is None:   # what the cell defines; the modules it imports stay out of the notebook
        names = [n for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)]
    return {n: getattr(module, n) for n in names}


def run_module_cell(source: str, namespace: dict, directory: str | os.PathLike | None = None) -> types.ModuleType:
    """Do what the magic does with a ``%%module NAME`` cell's ``source``: write and import the
    module, then bind it and its public names in ``namespace``. Returns the module."""
    cell = module_cell(source)
    if cell is None:
        raise ValueError(f"source must start with %%{MAGIC} NAME")
    name, body = cell
    module = write_module(name, body, directory)
    namespace.update(_public(module))
    namespace[name] = module
    return module


def _magic(line: str, cell: str) -> None:
    from IPython import get_ipython

    shell = get_ipython()
    run_module_cell(f"%%{MAGIC} {line}\n{cell}", shell.user_ns)


def register(ipython=None) -> bool:
    """Make ``%%module`` available in this IPython session; returns whether it is (False outside IPython)."""
    if ipython is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return False
        ipython = get_ipython()
    if ipython is None:
        return False
    ipython.register_magic_function(_magic, magic_kind="cell", magic_name=MAGIC)
    return True


def load_ipython_extension(ipython) -> None:
    """``%load_ext llmu.cell_module``."""
    register(ipython)
