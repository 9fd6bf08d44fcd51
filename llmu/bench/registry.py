"""The benchmark registry: one entry per op of the course.

An entry says how to build inputs for a problem size, how many floating-point operations and
bytes of memory traffic one call costs (so timings turn into TFLOP/s, GB/s and a fraction of the
device's peak), which implementations ("providers") to time, and which sizes matter on a GPU and
which are small enough for a CPU.

Each course module registers its entries in ``llmu/<topic>/bench.py``; ``load_all()`` imports
those modules. Providers of kind ``"triton"`` are timed only on a GPU: in the interpreter their
timings say nothing about the kernel.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PROVIDER_KINDS = ("triton", "torch", "builtin", "external")


@dataclass(frozen=True)
class Provider:
    """One implementation of an op. ``fn(*inputs)`` runs it once on inputs made by ``Entry.setup``."""

    fn: Callable
    kind: str  # "triton" (llmu kernel), "torch" (llmu reference), "builtin" (PyTorch's own), "external"
    label: str = ""
    #: the name of another provider of the entry whose output this one must match before it is
    #: timed (a learner's kernel is checked against llmu's); None: timed as it is
    check_against: str | None = None

    def __post_init__(self):
        if self.kind not in PROVIDER_KINDS:
            raise ValueError(f"Provider.kind must be one of {PROVIDER_KINDS}, got {self.kind!r}")


@dataclass
class Entry:
    """A benchmarked op.

    ``setup(size, device, dtype)`` returns the tuple of inputs passed to every provider.
    ``flops(size)`` and ``bytes(size, elem_bytes)`` are the per-call costs, written out as formulas
    (they are what the roofline of module 05 plots). ``size`` is a plain dict such as
    ``{"M": 4096, "N": 4096}``.

    Whole-model measurements (tokens per second) set ``run`` instead: ``run(size, device)`` returns
    a list of result rows (dicts) and the generic timer is not used.
    """

    name: str
    module: str
    description: str
    providers: dict[str, Provider] = field(default_factory=dict)
    setup: Callable | None = None
    flops: Callable[[dict], float] | None = None
    bytes: Callable[[dict, int], float] | None = None
    gpu_sizes: list[dict] = field(default_factory=list)
    cpu_sizes: list[dict] = field(default_factory=list)
    gpu_dtype: torch.dtype = torch.bfloat16
    cpu_dtype: torch.dtype = torch.float32
    run: Callable | None = None
    x_axis: str | None = None  # the size key plotted on the x axis

    def __post_init__(self):
        if self.run is None and (self.setup is None or not self.providers):
            raise ValueError(f"benchmark entry {self.name!r} needs either run= or setup= and providers=")


REGISTRY: dict[str, Entry] = {}

# Topic packages that register benchmark entries, in course order.
TOPICS = ["welcome", "tokenization", "embeddings", "attention", "layers", "training", "models", "roofline", "kvcache", "gqa", "flash", "paged",
          "quant", "spec", "moe", "mamba", "parallel", "scale", "engine"]


def register(entry: Entry) -> Entry:
    """Add ``entry`` to the registry (names are unique)."""
    if entry.name in REGISTRY and REGISTRY[entry.name] is not entry:
        raise ValueError(f"a benchmark named {entry.name!r} is already registered")
    REGISTRY[entry.name] = entry
    return entry


#: Topic bench modules that failed to import under ``load_all(strict=False)``: module -> reason.
LOAD_ERRORS: dict[str, str] = {}


#: Environment variable naming more modules (space- or comma-separated) whose import registers
#: entries, loaded after the topics' like them: an instructor's own benchmarks, or a test's.
EXTRA_MODULES_ENV = "LLMU_BENCH_MODULES"


def bench_modules() -> list[str]:
    """The modules :func:`load_all` imports: ``llmu.<topic>.bench`` for every topic, in course
    order, then those named in ``$LLMU_BENCH_MODULES``."""
    extra = os.environ.get(EXTRA_MODULES_ENV, "").replace(",", " ").split()
    return [f"llmu.{topic}.bench" for topic in TOPICS] + extra


def load_all(strict: bool = True) -> dict[str, Entry]:
    """Import every topic's ``bench`` module (and those of ``$LLMU_BENCH_MODULES``) and return the
    registry.

    A topic without a ``bench`` module is skipped; a module named in ``$LLMU_BENCH_MODULES`` that
    does not exist is an error. With ``strict=False`` a bench module that fails to import (say, a
    dependency missing on a GPU machine) is recorded in :data:`LOAD_ERRORS` instead of stopping
    the others.
    """
    topic_modules = {f"llmu.{topic}.bench" for topic in TOPICS}
    for module in bench_modules():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module and module in topic_modules:
                continue
            if strict:
                raise
            LOAD_ERRORS[module] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - recorded, the other topics still load
            if strict:
                raise
            LOAD_ERRORS[module] = f"{type(exc).__name__}: {exc}"
        else:
            LOAD_ERRORS.pop(module, None)
    return REGISTRY
