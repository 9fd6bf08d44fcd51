"""llmu.cell_module: a ``%%module NAME`` cell becomes NAME.py, imported, and usable on other processes."""

from __future__ import annotations

import sys
import textwrap

import pytest

from llmu import cell_module
from llmu.cell_module import HEADER, module_cell, python_of, run_module_cell, write_module, written_by_magic
from llmu.distributed import launch


@pytest.fixture
def name(request):
    """A module name no other test uses, removed from sys.modules afterwards."""
    n = f"llmu_cell_{request.node.name.split('[')[0].removeprefix('test_')}"
    yield n
    sys.modules.pop(n, None)


def test_the_module_is_written_with_its_header_and_imported(tmp_path, name):
    module = write_module(name, "X = 41\ndef f():\n    return X + 1\n", tmp_path)
    text = (tmp_path / f"{name}.py").read_text()
    assert text.splitlines()[0] == HEADER and written_by_magic(tmp_path / f"{name}.py")
    assert module.f() == 42 and module.__file__ == str(tmp_path / f"{name}.py")
    assert sys.modules[name] is module and module.f.__module__ == name


def test_running_the_cell_again_takes_the_edit(tmp_path, name):
    write_module(name, "X = 1\n", tmp_path)
    assert write_module(name, "X = 2\n", tmp_path).X == 2
    assert sys.modules[name].X == 2


def test_a_file_not_written_by_the_magic_is_never_overwritten(tmp_path, name):
    mine = tmp_path / f"{name}.py"
    mine.write_text("# my own notes\nY = 1\n")
    with pytest.raises(FileExistsError, match="not written by %%module"):
        write_module(name, "X = 1\n", tmp_path)
    assert mine.read_text() == "# my own notes\nY = 1\n"


def test_a_cell_that_raises_leaves_the_previous_module(tmp_path, name):
    first = write_module(name, "X = 1\n", tmp_path)
    with pytest.raises(ZeroDivisionError):
        write_module(name, "X = 1 / 0\n", tmp_path)
    assert sys.modules[name] is first


@pytest.mark.parametrize("bad, error", [("torch", ValueError), ("math", ValueError), ("my-dp", ValueError),
                                        ("class", ValueError), ("", ValueError), (3, TypeError)])
def test_bad_names_are_refused(tmp_path, bad, error):
    with pytest.raises(error, match="name"):
        write_module(bad, "X = 1\n", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_module_cell_and_python_of():
    assert module_cell("x = 1\n") is None
    assert module_cell("%%module my_dp\nimport torch\n") == ("my_dp", "import torch\n")
    assert python_of("%%module my_dp\ndef f():\n    pass\n").endswith("import my_dp\n")
    assert python_of("x = 1\n") == "x = 1\n"
    for bad in ("%%module\nx = 1\n", "%%module a b\nx = 1\n"):
        with pytest.raises(ValueError, match="one argument"):
            module_cell(bad)


def test_run_module_cell_binds_the_module_and_its_public_names(tmp_path, name):
    ns: dict = {}
    run_module_cell(f"%%module {name}\ndef f():\n    return 3\n_hidden = 1\n", ns, tmp_path)
    assert ns["f"]() == 3 and ns[name].f is ns["f"] and "_hidden" not in ns
    run_module_cell(f"%%module {name}\n__all__ = ['g']\ndef g():\n    return 4\ndef h():\n    pass\n", ns, tmp_path)
    assert ns["g"]() == 4 and "h" not in ns


def test_the_magic_in_ipython(tmp_path, name, monkeypatch):
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    assert cell_module.register(shell)
    monkeypatch.chdir(tmp_path)
    result = shell.run_cell(f"%%module {name}\ndef twice(x):\n    return 2 * x\n")
    assert result.success, result.error_in_exec
    assert shell.user_ns["twice"](21) == 42 and (tmp_path / f"{name}.py").is_file()


def test_a_function_of_the_module_runs_on_other_processes(tmp_path, name):
    """What the magic is for: launch finds the function by its module's file."""
    module = write_module(name, textwrap.dedent("""
        import torch
        import torch.distributed as dist

        def summed(rank, world_size):
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            return t.item()
    """), tmp_path)
    assert launch(module.summed, 2) == [3.0, 3.0]


def test_a_module_of_that_name_from_another_folder_is_replaced(tmp_path, name):
    """The same notebook run from two folders in one kernel: the second cell's file wins."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_module(name, "X = 1\n", tmp_path / "a")
    assert write_module(name, "X = 2\n", tmp_path / "b").__file__ == str(tmp_path / "b" / f"{name}.py")


def test_a_module_whose_folder_is_gone_is_replaced(tmp_path, name):
    import shutil

    (tmp_path / "a").mkdir()
    write_module(name, "X = 1\n", tmp_path / "a")
    shutil.rmtree(tmp_path / "a")
    assert write_module(name, "X = 2\n", tmp_path).X == 2
