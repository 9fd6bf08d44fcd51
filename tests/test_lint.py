"""The lint: ruff with the rules of pyproject.toml's [tool.ruff] (E, F, W, B, I) finds nothing.

It runs in `make test` and `make test-fast` (and so in CI); `make lint` runs it alone, and
`.venv/bin/ruff check --fix` mends the import order. A finding names the file, the line and the
rule; `# noqa: RULE` with the reason on that line is for the rare place where the rule is wrong.
"""

from __future__ import annotations

import subprocess
import sys

from llmu import course

ROOT = course.repo_root()


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "No module named ruff" not in done.stderr, "ruff is not installed: `make setup-dev` installs the dev extra"
    assert done.returncode == 0, f"ruff check found problems:\n{done.stdout}{done.stderr}"
