"""Benchmarks of the course's ops: the registry, the runner, results files and plots.

* :mod:`llmu.bench.registry`: :class:`Entry`, :class:`Provider`, :func:`register`, :func:`load_all`
  (each course module registers its entries in ``llmu/<topic>/bench.py``);
* :func:`run` times entries on the current device and returns JSON-ready results (``yours=``
  adds a learner's kernel beside llmu's); :func:`untimed_note` says which rows were not timed, and why;
* :func:`save`, :func:`load`, :func:`recorded` and :func:`recorded_summary` (the GPU results
  recorded in ``llmu/data/gpu_results/``, :data:`RESULTS_DIR`);
* :func:`figure` plots one entry, live rows beside recorded ones;
* :func:`interleave` (:mod:`llmu.bench.paired`) compares whole-model runs: providers called in
  turn, round after round, and the per-round (paired) ratios with their spread;
* :func:`cli_main` is ``llmu bench`` (also ``python -m llmu.bench``).

This package imports neither plotly nor the course modules until asked, so ``llmu bench`` runs on
a GPU machine that has only torch and Triton.
"""

from llmu.bench.cli import cli_main, format_table
from llmu.bench.paired import PAIRED_FIELDS, Paired, first_difference, interleave, timed
from llmu.bench.peaks import GPU_PEAKS, Peak, peak_for
from llmu.bench.registry import PROVIDER_KINDS, REGISTRY, TOPICS, Entry, Provider, load_all, register
from llmu.bench.results import RESULTS_DIR, load, recorded, recorded_summary, results_dir, run_label, save
from llmu.bench.runner import (
    ROW_FIELDS,
    SCHEMA_VERSION,
    YOURS,
    YOURS_TOLERANCE,
    environment_info,
    run,
    throughput,
    time_cpu,
    time_cuda,
    untimed_note,
)


def figure(results_or_rows, name: str, **kwargs):
    """Plot entry ``name`` (see :func:`llmu.bench.plot.figure`; imports plotly on first use)."""
    from llmu.bench.plot import figure as _figure

    return _figure(results_or_rows, name, **kwargs)


__all__ = [
    "Entry", "Provider", "register", "load_all", "REGISTRY", "TOPICS", "PROVIDER_KINDS",
    "run", "save", "load", "recorded", "recorded_summary", "run_label", "results_dir", "RESULTS_DIR",
    "figure", "cli_main", "format_table",
    "throughput", "time_cpu", "time_cuda", "environment_info", "peak_for", "Peak", "GPU_PEAKS",
    "ROW_FIELDS", "SCHEMA_VERSION", "YOURS", "YOURS_TOLERANCE", "untimed_note",
    "interleave", "Paired", "timed", "first_difference", "PAIRED_FIELDS",
]
