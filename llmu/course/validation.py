"""Validate: run a notebook as nbgrader does and return its verdict.

Also what the course checks of a notebook that has run, wherever it ran (nbclient here, JupyterLab
in the browser tests): nbgrader's verdict on its outputs (:func:`validate_executed`), its peak
memory (a probe cell, :func:`add_memory_probe`) and its cells' times (:func:`cell_seconds`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime
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


def _make_validator(config, execute: bool = True):
    from nbgrader.preprocessors import CheckCellMetadata
    from nbgrader.validator import Validator

    class _KeepingValidator(Validator):
        """nbgrader's Validator that also keeps the notebook it executed."""

        executed = None

        def _preprocess(self, nb):
            nb = super()._preprocess(nb)
            self.executed = nb
            return nb

    validator = _KeepingValidator(config=config)
    if not execute:  # judge the outputs the notebook holds: no ClearOutput, no Execute
        validator.preprocessors = [CheckCellMetadata]
    return validator


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




def validate_executed(path, *, invert: bool = False, root=None) -> dict:
    """nbgrader's verdict on a notebook that has already run (saved from JupyterLab, say), from the
    outputs it holds: the same result dictionary as :func:`validate`, without running it again."""
    config = nbgrader_config(root)
    config.Validator.invert = invert
    return _make_validator(config, execute=False).validate(str(Path(path).resolve()))


#: Source of the cell :func:`add_memory_probe` appends. It prints the kernel's own peak resident
#: memory: on Linux VmHWM, the high-water mark of the kernel's address space, which starts at zero
#: when the kernel process is exec'd. getrusage's ru_maxrss is not: Linux carries it over from the
#: process that started the kernel (a test worker holding several models, say). Elsewhere, ru_maxrss.
MEMORY_PROBE = (
    "import re as _re, resource as _r, sys as _s\n"
    "try:\n"
    "    _peak = int(_re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)) / 1024\n"
    "except (OSError, AttributeError):\n"
    "    _peak = _r.getrusage(_r.RUSAGE_SELF).ru_maxrss / (1024 * 1024 if _s.platform == 'darwin' else 1024)\n"
    "print('LLMU_PEAK_RSS_MB', _peak)"
)


def add_memory_probe(path) -> None:
    """Append the :data:`MEMORY_PROBE` cell to the notebook at ``path`` (a copy: never a course notebook)."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(MEMORY_PROBE))
    nbformat.write(nb, str(path))


def peak_rss_mb(nb) -> float:
    """What the memory probe (the notebook's last cell) printed, in MB."""
    # The kernel may deliver one print() as several stream chunks: join them before reading.
    text = "".join(o.get("text", "") for o in nb.cells[-1].get("outputs", []) if o.get("output_type") == "stream")
    found = re.search(r"LLMU_PEAK_RSS_MB\s+([0-9.]+)", text)
    if found:
        return float(found.group(1))
    raise ValueError(f"the memory probe printed nothing: {nb.cells[-1].get('outputs')}")


def cell_seconds(cell) -> float | None:
    """How long a cell ran, from the timing nbclient (``record_timing``) and JupyterLab
    (``recordTiming``) store in its metadata; None when it has none."""
    ex = cell.get("metadata", {}).get("execution", {})
    try:
        start = datetime.fromisoformat(ex["iopub.execute_input"].replace("Z", "+00:00"))
        end = datetime.fromisoformat(ex["shell.execute_reply"].replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None
    return (end - start).total_seconds()
