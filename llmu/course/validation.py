"""Validate: run a notebook as nbgrader does and return its verdict."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


from .paths import CELL_TIMEOUT
from .settings import nbgrader_config


@dataclass
class ValidationRun:
    """What :func:`execute_and_validate` found: nbgrader's verdict and the executed notebook."""

    path: Path
    results: dict
    notebook: object  # nbformat.NotebookNode, executed
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.results


def _make_validator(config):
    from nbgrader.validator import Validator

    class _KeepingValidator(Validator):
        """nbgrader's Validator that also keeps the notebook it executed."""

        executed = None

        def _preprocess(self, nb):
            nb = super()._preprocess(nb)
            self.executed = nb
            return nb

    return _KeepingValidator(config=config)


def execute_and_validate(path, *, invert: bool = False, timeout: int = CELL_TIMEOUT, root=None) -> ValidationRun:
    """Run nbgrader's validator on ``path`` and keep the notebook it executed.

    The result dictionary is empty when the notebook passes. Otherwise it has ``failed`` (graded
    cells that raised), ``changed`` (locked cells whose checksum changed), ``type_changed``, or with
    ``invert=True`` ``passed`` (graded cells that passed; a released notebook should have none).
    The notebook is executed once, with nbclient under nbgrader's ``Execute`` (widget state is
    stored, each cell limited to ``timeout`` seconds).
    """
    config = nbgrader_config(root, timeout=timeout)
    config.Validator.invert = invert
    config.Execute.store_widget_state = True
    config.Execute.record_timing = True
    v = _make_validator(config)
    path = Path(path).resolve()
    t0 = time.perf_counter()
    results = v.validate(str(path))
    return ValidationRun(path=path, results=results, notebook=v.executed, seconds=time.perf_counter() - t0)


def validate(path, *, invert: bool = False, timeout: int = CELL_TIMEOUT, root=None) -> dict:
    """nbgrader validation of one notebook: ``{}`` when it passes (see :func:`execute_and_validate`).

    Use this, never the exit code of ``nbgrader validate`` (it is 0 even when validation fails).
    """
    return execute_and_validate(path, invert=invert, timeout=timeout, root=root).results


