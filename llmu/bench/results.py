"""Benchmark results on disk: save, load, and the GPU results recorded in ``llmu/data/gpu_results/``.

A results file is the JSON that :func:`llmu.bench.run` returns: a schema version, the date, the
environment (GPU, driver, CUDA, torch, Triton, threads) and one row per (entry, provider, size).
``benchmarks/gpu.sh`` writes one per GPU run into :data:`RESULTS_DIR`, inside the package, so that
an installed llmu (a wheel, as on Colab) has them too. The notebooks plot those recorded rows next
to what they measure live, labelled with the GPU, the date and the versions, and
:func:`recorded_summary` says in one sentence what was recorded, or that nothing has been yet.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from llmu.bench.runner import SCHEMA_VERSION

#: Where recorded GPU results live: ``llmu/data/gpu_results/*.json``, shipped with the package.
#: ``benchmarks/gpu.sh`` writes there; ``$LLMU_RESULTS_DIR`` points :func:`results_dir` elsewhere.
RESULTS_DIR = Path(__file__).resolve().parents[1] / "data" / "gpu_results"


def results_dir() -> Path:
    """Where recorded results are read from: ``$LLMU_RESULTS_DIR`` when set, else :data:`RESULTS_DIR`."""
    override = os.environ.get("LLMU_RESULTS_DIR")
    return Path(override) if override else RESULTS_DIR


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


def _version(value) -> str | None:
    """``"2.11.0+cu130"`` -> ``"2.11.0"``: the build suffix repeats what the CUDA version says."""
    return str(value).split("+", 1)[0] if value else None


def run_label(results: dict) -> str:
    """Where and with what a results file was measured, for a legend or a sentence:
    ``"H200, 2025-06-01 (torch 2.11.0, Triton 3.6.0, CUDA 13.0)"``. Missing fields are left out."""
    env = results.get("environment") or {}
    versions = [f"{what} {v}" for what, v in (("torch", _version(env.get("torch"))),
                                             ("Triton", _version(env.get("triton"))),
                                             ("CUDA", env.get("cuda"))) if v]
    date = str(results.get("created") or "")[:10]
    label = ", ".join(x for x in (device_label(results), date) if x)
    return f"{label} ({', '.join(versions)})" if versions else label


def _recorded_files(directory) -> list[tuple[Path, dict]]:
    """Every readable results file of ``directory`` (default :func:`results_dir`), by file name."""
    folder = Path(directory) if directory is not None else results_dir()
    if not folder.is_dir():
        return []
    files = []
    for path in sorted(folder.glob("*.json")):
        try:
            files.append((path, load(path)))
        except (ValueError, OSError) as exc:
            warnings.warn(f"skipping {path.name}: {exc}", stacklevel=3)
    return files


def recorded(name: str, directory: str | os.PathLike | None = None) -> list[dict]:
    """The rows for entry ``name`` from every recorded results file (:data:`RESULTS_DIR`).

    Only rows that measured something (``status == "ok"``) are returned, each with more keys so a
    plot can label them: ``recorded`` (True), ``source`` (the file name), ``device_name`` (e.g.
    ``"H200"``), ``date`` (``YYYY-MM-DD``), ``created`` and ``run_label`` (:func:`run_label`: GPU,
    date, torch, Triton and CUDA versions). No folder or no file gives an empty list.
    """
    rows = []
    for path, data in _recorded_files(directory):
        extra = {"recorded": True, "source": path.name, "device_name": device_label(data),
                 "date": str(data.get("created", ""))[:10], "created": data.get("created"),
                 "run_label": run_label(data)}
        rows += [{**row, **extra} for row in data["rows"] if row.get("entry") == name and row.get("status") == "ok"]
    return rows


def recorded_summary(name: str | None = None, directory: str | os.PathLike | None = None) -> str:
    """One honest sentence for a notebook: which GPU runs were recorded (for entry ``name``, or any
    entry), each with its GPU, date and versions, or that none have been recorded yet."""
    runs = []
    for _, data in _recorded_files(directory):
        if any(row.get("status") == "ok" and (name is None or row.get("entry") == name) for row in data["rows"]):
            runs.append(run_label(data))
    what = f" for {name}" if name else ""
    if not runs:
        return (f"No GPU results{what} have been recorded yet; `benchmarks/gpu.sh` records them on a GPU, "
                "into llmu/data/gpu_results/.")
    return f"GPU results{what} recorded on " + "; ".join(dict.fromkeys(runs)) + "."


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
