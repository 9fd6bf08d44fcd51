"""pyproject.toml builds without deprecation warnings, and says its license as packaging now wants.

Every set-up (``make lab``, ``make test``, Binder's postBuild) builds llmu's metadata; a warning
there is printed to every newcomer, and setuptools's deprecations end in builds that stop working
(the table form of ``project.license`` stops after 2027-02-18).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib

from packaging.licenses import canonicalize_license_expression
from packaging.requirements import Requirement

from llmu import course

ROOT = course.repo_root()


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_license_is_an_spdx_expression_with_its_file():
    project = _pyproject()["project"]
    assert isinstance(project["license"], str), "project.license must be an SPDX string, not a table"
    assert canonicalize_license_expression(project["license"]) == project["license"] == "Apache-2.0"
    for name in project["license-files"]:
        text = (ROOT / name).read_text()
        assert "Apache License" in text and "Version 2.0, January 2004" in text, name
    # the SPDX form needs setuptools 77 in the build environment
    setuptools = next(Requirement(r) for r in _pyproject()["build-system"]["requires"]
                      if Requirement(r).name == "setuptools")
    assert not setuptools.specifier.contains("76.9") and setuptools.specifier.contains("77.0")


def test_building_the_metadata_prints_no_deprecation(tmp_path):
    """What pip does first on every install of llmu, here with the venv's setuptools."""
    code = ("import warnings; warnings.simplefilter('always'); from setuptools import build_meta; "
            f"print(build_meta.prepare_metadata_for_build_wheel({str(tmp_path)!r}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    output = done.stdout + done.stderr
    assert "Deprecat" not in output, output[-3000:]
    metadata = (tmp_path / done.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
