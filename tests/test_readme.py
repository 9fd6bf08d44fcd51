"""The commands the READMEs tell a reader to type work as typed, from a fresh clone after `make lab`.

Nothing activates ``.venv``: a command that lives only there (``llmu``, ``nbgrader``, ``jupyter``,
``python``) is typed with its path (``.venv/bin/llmu doctor``), and this test refuses the bare
name in a code block. Each command of every ``bash`` block is checked against what it names: a
``make`` target in the Makefile, an ``llmu`` subcommand of the CLI's parser, a script in the
checkout (executable, relative to the folder the block has ``cd``-ed into), or a program the system
has. Arguments in capitals or brackets (``NOTEBOOK.ipynb``, ``[NAME]``) are placeholders.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from llmu import cli, course

ROOT = course.repo_root()
READMES = ["README.md", "autograder/README.md"]
#: Installed into the venv by `make lab` / `make test`, on no PATH until the venv is activated.
VENV_ONLY = {"llmu", "python", "pip", "jupyter", "jupyter-lab", "nbgrader", "pytest"}
#: What a fresh machine has (the README's first lines need only python3 and make).
SYSTEM = {"python3", "make", "git", "cd", "mkdir", "source", "ls", "cat", "export", "OMP_NUM_THREADS=1"}


def _bash_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, body) of each ```bash block."""
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```bash\n(.*?)```", text, re.S)]


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w.-]*):", (ROOT / "Makefile").read_text(), re.M))


def _llmu_subcommands() -> set[str]:
    action = next(a for a in cli._parser()._actions if a.dest == "command")
    return set(action.choices)


def _problems(block: str) -> list[str]:
    problems, cwd = [], ROOT
    venv_scripts = Path(sys.executable).parent
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        commands, current = [], []
        for w in words:                      # split on && ; | (written with spaces, as the READMEs do)
            if w in ("&&", ";", "|", "||"):
                commands.append(current)
                current = []
            else:
                current.append(w)
        commands.append(current)
        for cmd in filter(None, commands):
            head, args = cmd[0], cmd[1:]
            where = f"`{' '.join(cmd)}`"
            if head == "cd":
                cwd = (cwd / args[0]).resolve() if args else ROOT
            elif head == "make":
                targets = [a for a in args if "=" not in a and not a.startswith("-")]
                missing = [t for t in targets if t not in _makefile_targets()]
                if missing:
                    problems.append(f"{where}: no Makefile target {missing}")
            elif head in VENV_ONLY:
                problems.append(f"{where}: `{head}` is not on PATH without an activated venv; "
                                f"write .venv/bin/{head} (relative to where the block is)")
            elif "/" in head:
                path = (cwd / head)
                if ".venv/bin/" in head:         # the venv the tests run in stands for the reader's
                    name = path.name
                    if os.path.normpath(str(path.parent)) != os.path.normpath(str(ROOT / ".venv" / "bin")):
                        problems.append(f"{where}: {head} is not the checkout's .venv/bin from {cwd}")
                    if not (venv_scripts / name).exists():
                        problems.append(f"{where}: no `{name}` in the venv's scripts")
                    if name == "llmu" and (not args or args[0] not in _llmu_subcommands()):
                        problems.append(f"{where}: not an llmu subcommand (known: {sorted(_llmu_subcommands())})")
                elif not path.is_file() or not os.access(path, os.X_OK):
                    problems.append(f"{where}: {path} is not an executable file of the checkout")
            elif head not in SYSTEM:
                problems.append(f"{where}: `{head}` is neither a make target, a script of the checkout, "
                                f"nor a program of a fresh machine")
    return problems


@pytest.mark.parametrize("readme", READMES)
def test_every_command_in_the_readme_works_as_typed(readme):
    text = (ROOT / readme).read_text()
    blocks = _bash_blocks(text)
    assert blocks, f"{readme} has no ```bash blocks"
    problems = [f"{readme}:{line}: {p}" for line, body in blocks for p in _problems(body)]
    assert not problems, "\n".join(problems)


def test_the_readme_starts_with_the_two_commands_of_a_newcomer():
    first = _bash_blocks((ROOT / "README.md").read_text())[0]
    assert first[0] <= 5, "the first lines of README.md are the two commands"
    assert [shlex.split(line, comments=True) for line in first[1].strip().splitlines()] == \
        [["make", "lab"], ["make", "test"]]


@pytest.mark.parametrize("line, expected", [
    ("llmu doctor", "`llmu` is not on PATH"),
    ("cd autograder && nbgrader export", "`nbgrader` is not on PATH"),
    (".venv/bin/llmu docter", "not an llmu subcommand"),
    ("make labs", "no Makefile target ['labs']"),
    ("autograder/regrade 00_welcome", "is not an executable file of the checkout"),
    ("cd autograder && .venv/bin/llmu doctor", "is not the checkout's .venv/bin"),
    ("pytest -q", "`pytest` is not on PATH"),
])
def test_the_checker_refuses_what_would_not_run(line, expected):
    assert any(expected in p for p in _problems(line)), _problems(line)


def test_the_checker_accepts_what_runs():
    assert _problems("make lab\nmake release FORCE=1\n.venv/bin/llmu grade NOTEBOOK.ipynb   # comment\n"
                     "autograder/export --to x.csv\ncd autograder && ../.venv/bin/nbgrader export\n"
                     "../.venv/bin/llmu release   # still in autograder/: a cd lasts for the block") == []
