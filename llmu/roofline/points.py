"""The course's registered ops as points on a roofline.

Every benchmark entry (``llmu.bench.registry``) carries its FLOPs and bytes per call as formulas,
so its arithmetic intensity at any size is known without running it. :func:`registry_points`
turns each (entry, size) into a point, and says whether the size is *prefill-like* (many tokens
per weight read), *decode-like* (one token, or a small batch of them, per weight read), or
whether the op has no such distinction: an elementwise or row-wise op (softmax, RMSNorm, RoPE,
SwiGLU's gate) does a fixed number of operations per element it reads, so its intensity is the
same whatever the number of tokens, in prefill and in decode alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from llmu.roofline.model import Roof

__all__ = ["PHASES", "phase_of", "registry_points"]


def _gemv_phase(size: dict) -> tuple[str, str]:
    b = size.get("B", 1)
    return "decode", ("one token per weight read" if b == 1 else
                      f"a batch of {b} sequences decoding together: intensity about {b}x a GEMV's")


def _moe_phase(size: dict) -> tuple[str, str]:
    t, k, e = size["T"], size["k"], size["E"]
    return "prefill", (f"{t} tokens, {k} of {e} experts each: about {t * k / e:.0f} tokens per read of an "
                       "expert's weights (a decode batch of a few sequences gives each expert one or two)")


#: entry name -> rule(size) -> (phase, note). Entries not listed are classified by
#: :func:`phase_of` from how their intensity changes with size.
PHASES: dict[str, Callable[[dict], tuple[str, str]]] = {
    "gemm": lambda s: ("prefill", f"{s['M']} tokens through a {s['K']} x {s['N']} weight"),
    "gemv": _gemv_phase,
    "cosine_similarity": lambda s: (("decode", "one query against the whole embedding table: a GEMV")
                                    if s["Q"] == 1 else
                                    ("prefill", f"{s['Q']} queries share each read of the table")),
    "attention_naive": lambda s: ("prefill", f"{s['T']} queries against {s['T']} keys (decode would be "
                                             "1 query against T cached keys: module 06)"),
    "moe_grouped_gemm": _moe_phase,
    "moe_grouped_gemm_fine": _moe_phase,
    "moe_layer": _moe_phase,
}


def phase_of(entry, size: dict, elem_bytes: int = 2) -> tuple[str, str]:
    """``(phase, note)`` of one size of a registered entry: ``phase`` is ``"prefill"``,
    ``"decode"``, ``"both"`` (no distinction: the intensity does not depend on the size) or
    ``"unclassified"``."""
    if entry.name in PHASES:
        return PHASES[entry.name](size)
    for phase in ("decode", "prefill"):  # an entry named for its phase (module 06's decode_attention)
        if phase in entry.name:
            return phase, f"the entry is named for the {phase} phase"
    sizes = entry.gpu_sizes or entry.cpu_sizes
    values = [entry.flops(s) / entry.bytes(s, elem_bytes) for s in sizes]
    if values and max(values) <= 1.05 * min(values):
        return "both", ("a fixed number of operations per element moved: the same intensity "
                        "for any number of tokens, in prefill and in decode")
    return "unclassified", "intensity changes with size; no prefill/decode rule is recorded for this op"


def registry_points(roof: Roof | None = None, elem_bytes: int = 2, sizes: str = "gpu",
                    names: Iterable[str] | None = None, entries=None) -> list[dict]:
    """One point per (entry, size) of the registry that has FLOP and byte formulas.

    ``sizes``: ``"gpu"`` (default, the sizes that matter on a GPU) or ``"cpu"``. ``elem_bytes``:
    bytes per element in the byte formulas (2 for bf16). ``names``: only these entries.
    ``entries``: a mapping name -> Entry to use instead of ``llmu.bench.load_all()``.
    With a ``roof``, each point also gets ``attainable`` (FLOP/s the roofline allows there) and
    ``bound`` (``"memory"`` or ``"compute"`` on that device).
    """
    if sizes not in ("gpu", "cpu"):
        raise ValueError(f"sizes must be 'gpu' or 'cpu', got {sizes!r}")
    if entries is None:
        from llmu.bench.registry import load_all

        entries = load_all(strict=False)
    wanted = None if names is None else set(names)
    if wanted is not None and wanted - set(entries):
        raise ValueError(f"unknown entry name(s) {sorted(wanted - set(entries))}")
    from llmu.bench.runner import size_label

    points = []
    for name, entry in entries.items():
        if (wanted is not None and name not in wanted) or entry.flops is None or entry.bytes is None:
            continue
        for size in entry.gpu_sizes if sizes == "gpu" else entry.cpu_sizes:
            flops, nbytes = float(entry.flops(size)), float(entry.bytes(size, elem_bytes))
            if not (flops > 0 and nbytes > 0):
                continue
            phase, note = phase_of(entry, size, elem_bytes)
            point = dict(entry=name, module=entry.module, size=dict(size), size_label=size_label(size),
                         phase=phase, note=note, flops=flops, bytes=nbytes, intensity=flops / nbytes)
            if roof is not None:
                point["attainable"] = roof.attainable(point["intensity"])
                point["bound"] = roof.bound(point["intensity"])
            points.append(point)
    return points
