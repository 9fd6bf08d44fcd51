"""The Makefile on the path a newcomer takes when something goes wrong half-way."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Stands in for python3: no torch; `-m venv DIR` makes DIR/bin/python, a Python whose pip fails, as
# when the network drops (or Ctrl-C lands) right after the venv was created.
_FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  for last; do :; done
  mkdir -p "$last/bin"
  printf '#!/bin/sh\\necho "pip: network is unreachable" >&2\\nexit 1\\n' > "$last/bin/python"
  chmod +x "$last/bin/python"
  exit 0
fi
exit 1
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_a_venv_whose_setup_failed_is_made_again(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    venv = tmp_path / ".venv"
    run = lambda: subprocess.run(["make", "-s", f"PYTHON={fake}", f"VENV={venv}", f"{venv}/bin/python"],  # noqa: E731
                                 cwd=tmp_path, capture_output=True, text=True, env=dict(os.environ))
    first = run()
    assert first.returncode != 0 and "network is unreachable" in first.stderr, first.stderr
    # the half-made venv's python is gone, so the next `make` creates the venv again
    assert not (venv / "bin" / "python").exists(), ("a failed venv set-up left .venv/bin/python behind: every "
                                                   "later `make` would skip creating the venv and fail")
    second = run()
    assert "network is unreachable" in second.stderr, "the second `make` did not try to set up the venv again"
