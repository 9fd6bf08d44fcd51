"""Benchmark results on disk: save, load, and the GPU results recorded in ``benchmarks/results/``.

A results file is the JSON that :func:`llmu.bench.run` returns: a schema version, the date, the
environment (GPU, driver, CUDA, torch, Triton, threads) and one row per (entry, provider, size).
``benchmarks/gpu.sh`` writes one per GPU run; the notebooks plot those recorded rows next to what
they measure live on the learner's machine.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from llmu.bench.runner import SCHEMA_VERSION

_REPO_ROOT = Path(__file__).resolve().parents[2]


def results_dir() -> Path:
    """Where recorded results live: ``$LLMU_RESULTS_DIR`` when set, else ``benchmarks/results/`` of
    the source checkout (an editable install; a wheel install has none and records nothing)."""
    override = os.environ.get("LLMU_RESULTS_DIR")
    return Path(override) if override else _REPO_ROOT / "benchmarks" / "results"


def save(results: dict, path: str | os.PathLike) -> Path:
    """Write ``results`` as indented JSON (parent folders are created). Returns the path."""
    if "rows" not in results or "schema_version" not in results:
        raise ValueError("results must be what llmu.bench.run() returns (with 'schema_version' and 'rows')")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=1, default=str)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)  # never leave half a file behind if the run is killed while writing
    return path


def load(path: str | os.PathLike) -> dict:
    """Read a results file written by :func:`save`; a file of another schema raises ValueError."""
    path = Path(path)
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "rows" not in data:
        raise ValueError(f"{path} is not an llmu benchmark results file (no 'rows')")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"{path} has results schema version {version!r}; this llmu reads {SCHEMA_VERSION}")
    return data


def device_label(results: dict) -> str:
    """A short name for the device a results file was measured on: ``"H200"``, ``"CPU, 2 threads"``."""
    env = results.get("environment") or {}
    name = env.get("gpu_name")
    if name:
        return name.removeprefix("NVIDIA ").removeprefix("Tesla ").strip()
    threads = env.get("threads")
    return f"CPU, {threads} thread{'s' if threads != 1 else ''}" if threads else "CPU"


def recorded(name: str, directory: str | os.PathLike | None = None) -> list[dict]:
    """The rows for entry ``name`` from every recorded results file (``benchmarks/results/*.json``).

    Only rows that measured something (``status == "ok"``) are returned, each with four more keys:
    ``recorded`` (True), ``source`` (the file name), ``device_name`` (e.g. ``"H200"``) and ``date``
    (``YYYY-MM-DD``), so a plot can label them. No folder or no file gives an empty list.
    """
    folder = Path(directory) if directory is not None else results_dir()
    if not folder.is_dir():
        return []
    rows = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = load(path)
        except (ValueError, OSError) as exc:
            warnings.warn(f"skipping {path.name}: {exc}", stacklevel=2)
            continue
        label = device_label(data)
        date = str(data.get("created", ""))[:10]
        for row in data["rows"]:
            if row.get("entry") == name and row.get("status") == "ok":
                rows.append({**row, "recorded": True, "source": path.name, "device_name": label,
                             "date": date, "created": data.get("created")})
    return rows


def resumable(path: str | os.PathLike, settings: dict, keys) -> dict | None:
    """The table a precompute script (``benchmarks/*.py --resume``) wrote at ``path``, to add rows to;
    ``None`` when there is no file. Exits with a message when the file was made with other
    ``settings`` (compared on ``keys``): rows measured under other settings must not be mixed."""
    path = Path(path)
    if not path.is_file():
        return None
    record = json.loads(path.read_text(encoding="utf-8"))
    differ = [k for k in keys if record.get(k) != settings[k]]
    if differ:
        raise SystemExit(f"{path} was made with other settings ({', '.join(differ)}): drop --resume or match them")
    print(f"resuming {path}: {len(record['rows'])} rows already measured", flush=True)
    return record
