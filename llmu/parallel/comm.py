"""The α–β cost model of collectives, and the links they run over.

Sending a message of ``n`` bytes over one link costs ``α + n/β``: a fixed latency ``α`` (software,
the network interface, the switches) and the bytes at the link's bandwidth ``β``. A collective is
a sequence of such steps, and its cost follows from counting them.

**Ring all-reduce.** ``p`` ranks in a ring, each holding ``n`` bytes cut into ``p`` chunks:

1. *reduce-scatter*, ``p - 1`` steps: at each step every rank sends one chunk (``n/p`` bytes) to
   its right neighbour and adds the chunk it receives from its left one; after ``p - 1`` steps rank
   ``r`` holds the complete sum of one chunk;
2. *all-gather*, ``p - 1`` more steps: the complete chunks travel once around the ring.

Every rank sends and receives at the same time, on different links, so each step costs
``α + (n/p)/β`` and

    T_all-reduce(n, p)  = 2(p-1)·α + 2·(p-1)/p · n/β
    T_all-gather(n, p)  = T_reduce-scatter(n, p) = (p-1)·α + (p-1)/p · n/β    (n: the full size)

The bandwidth term hardly grows with ``p``: ``2(p-1)/p < 2``, and no algorithm can do better
(each rank must send and receive at least ``2(p-1)/p · n`` bytes). The latency term grows
linearly: for small messages a ring is slow. A **tree** (a binomial reduce followed by a
broadcast, not pipelined) takes ``2⌈log2 p⌉`` steps of the whole message:

    T_tree(n, p) = 2⌈log2 p⌉ · (α + n/β)

latency-optimal, bandwidth-poor. :func:`crossover_bytes` finds the size where they cross.
NCCL picks per call between rings and (pipelined, double binary) trees, which get close to the
ring's bandwidth with the tree's ``log p`` latency.

**Bus bandwidth.** nccl-tests reports ``algbw = n / t`` and ``busbw = algbw · 2(p-1)/p`` for an
all-reduce (``(p-1)/p`` for all-gather and reduce-scatter): the bytes each rank's link actually
carried per second, comparable with the link's ``β`` whatever ``p`` is. :func:`bus_bandwidth`.

**Links** (:data:`LINKS`). Bandwidths per GPU, **per direction**, in GB/s (1e9 bytes/s): what a
ring uses, since each rank sends one way and receives the other at once. Vendors often quote the
sum of both directions; the ``quoted`` field keeps their figure.

- NVLink 4 (H100 / H200 SXM): 18 links of 25 GB/s per direction: **450 GB/s per direction, 900
  GB/s bidirectional** per GPU (NVIDIA's datasheets: "NVLink: 900 GB/s"). Through NVSwitch every
  GPU of an 8-GPU HGX board reaches every other at that rate.
- NVLink 5 (B200): 1.8 TB/s bidirectional, 900 GB/s per direction.
- InfiniBand NDR: **400 Gb/s per port** (bits), 50 GB/s per direction; an HGX H100 node has one
  ConnectX-7 port per GPU. XDR doubles it (800 Gb/s).
- PCIe 5.0 x16: 32 GT/s × 16 lanes × 128/130 encoding = **63 GB/s per direction** (about 128 GB/s
  both ways, the figure datasheets print).

The ``alpha`` values are not vendor figures: a collective step's latency depends on the software
stack as much as on the wire. They are typical orders of magnitude (microseconds within a node,
a few more across the network), there to make the small-message regime visible; fit them to
your own measurements with :func:`fit_alpha_beta`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Link", "LINKS", "NVLINK4", "NVLINK5", "INFINIBAND_NDR", "PCIE5_X16", "ring_all_reduce_time",
           "all_gather_time", "reduce_scatter_time", "tree_all_reduce_time", "crossover_bytes", "bus_bandwidth",
           "fit_alpha_beta"]


@dataclass(frozen=True)
class Link:
    """A link: ``beta`` bytes/s per direction, ``alpha`` seconds per step, what the vendor quotes."""

    name: str
    beta: float
    alpha: float
    quoted: str

    def __post_init__(self):
        for field in ("beta", "alpha"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Link.{field} must be a positive number, got {value!r}")


NVLINK4 = Link("NVLink 4 (H100/H200)", 450e9, 3e-6, "900 GB/s bidirectional per GPU (18 links x 50 GB/s)")
NVLINK5 = Link("NVLink 5 (B200)", 900e9, 3e-6, "1.8 TB/s bidirectional per GPU")
INFINIBAND_NDR = Link("InfiniBand NDR", 50e9, 6e-6, "400 Gb/s per port, each direction")
PCIE5_X16 = Link("PCIe 5.0 x16", 32e9 * 16 * 128 / 130 / 8, 5e-6,
                 "32 GT/s x 16 lanes: ~64 GB/s per direction, ~128 GB/s both")

LINKS = {link.name: link for link in (NVLINK4, NVLINK5, INFINIBAND_NDR, PCIE5_X16)}


def _check(n_bytes, p) -> None:
    if isinstance(n_bytes, bool) or not isinstance(n_bytes, (int, float)) or not n_bytes >= 0:
        raise ValueError(f"n_bytes must be a number >= 0, got {n_bytes!r}")
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"p (the number of ranks) must be a positive int, got {p!r}")


def _alpha_beta(link, alpha, beta) -> tuple[float, float]:
    if link is not None:
        if not isinstance(link, Link):
            raise TypeError(f"link must be an llmu.parallel.comm.Link, got {type(link).__name__}")
        return link.alpha, link.beta
    for name, value in (("alpha", alpha), ("beta", beta)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a number >= 0 (or pass link=), got {value!r}")
    if not beta > 0:
        raise ValueError(f"beta must be positive (bytes per second), got {beta!r}")
    return float(alpha), float(beta)


def ring_all_reduce_time(n_bytes: float, p: int, link: Link | None = None, *, alpha: float | None = None,
                         beta: float | None = None) -> float:
    """Seconds of a ring all-reduce of ``n_bytes`` over ``p`` ranks: ``2(p-1)α + 2(p-1)/p · n/β``.

    Give a ``link`` (:data:`LINKS`) or ``alpha`` (seconds) and ``beta`` (bytes/s per direction)."""
    _check(n_bytes, p)
    a, b = _alpha_beta(link, alpha, beta)
    return 2 * (p - 1) * a + 2 * (p - 1) / p * n_bytes / b


def all_gather_time(n_bytes: float, p: int, link: Link | None = None, *, alpha: float | None = None,
                    beta: float | None = None) -> float:
    """Seconds of a ring all-gather whose result is ``n_bytes``: ``(p-1)α + (p-1)/p · n/β``."""
    _check(n_bytes, p)
    a, b = _alpha_beta(link, alpha, beta)
    return (p - 1) * a + (p - 1) / p * n_bytes / b


def reduce_scatter_time(n_bytes: float, p: int, link: Link | None = None, *, alpha: float | None = None,
                        beta: float | None = None) -> float:
    """Seconds of a ring reduce-scatter of ``n_bytes`` per rank: the same cost as the all-gather."""
    return all_gather_time(n_bytes, p, link, alpha=alpha, beta=beta)


def tree_all_reduce_time(n_bytes: float, p: int, link: Link | None = None, *, alpha: float | None = None,
                         beta: float | None = None) -> float:
    """Seconds of a binomial-tree reduce then broadcast (not pipelined): ``2⌈log2 p⌉(α + n/β)``."""
    _check(n_bytes, p)
    a, b = _alpha_beta(link, alpha, beta)
    return 2 * math.ceil(math.log2(p)) * (a + n_bytes / b) if p > 1 else 0.0


def crossover_bytes(p: int, link: Link | None = None, *, alpha: float | None = None,
                    beta: float | None = None) -> float:
    """The message size above which the ring all-reduce beats the tree (``inf`` if it never does).

    Solves ``2(p-1)α + 2(p-1)/p·n/β = 2⌈log2 p⌉(α + n/β)`` for ``n``."""
    _check(0, p)
    a, b = _alpha_beta(link, alpha, beta)
    k = math.ceil(math.log2(p)) if p > 1 else 0
    slope = (k - (p - 1) / p) / b          # the tree's extra seconds per byte
    if slope <= 0:
        return math.inf
    return max(0.0, (p - 1 - k) * a / slope)


#: Bytes a rank's link carries in each collective, per byte of the message: nccl-tests' factors.
_BUS_FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p, "all_gather": lambda p: (p - 1) / p,
               "reduce_scatter": lambda p: (p - 1) / p}


def bus_bandwidth(n_bytes: float, seconds: float, p: int, op: str = "all_reduce") -> float:
    """nccl-tests' bus bandwidth in bytes/s: ``n / t · 2(p-1)/p`` for an all-reduce, ``· (p-1)/p``
    for an all-gather or reduce-scatter."""
    _check(n_bytes, p)
    if op not in _BUS_FACTOR:
        raise ValueError(f"op must be one of {tuple(_BUS_FACTOR)}, got {op!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"seconds must be a positive number, got {seconds!r}")
    return n_bytes / seconds * _BUS_FACTOR[op](p)


def fit_alpha_beta(n_bytes, seconds, p: int) -> tuple[float, float]:
    """``(alpha, beta)`` of the ring all-reduce model fitted to measured ``(n_bytes, seconds)`` pairs.

    Least squares on ``t = 2(p-1)·α + 2(p-1)/p · n · (1/β)``, weighted by ``1/t`` (a relative
    fit: the small messages count as much as the large ones). Needs two sizes at least; ``alpha``
    is clamped at 0."""
    sizes, times = [float(x) for x in n_bytes], [float(x) for x in seconds]
    if len(sizes) != len(times) or len(set(sizes)) < 2:
        raise ValueError("n_bytes and seconds must pair up, with at least two different sizes")
    if any(t <= 0 for t in times) or any(n < 0 for n in sizes):
        raise ValueError("seconds must be positive and n_bytes >= 0")
    _check(0, p)
    if p < 2:
        raise ValueError("an all-reduce over p=1 rank sends nothing: there is nothing to fit")
    # t/t_i = 1 = x1·(2(p-1)/t_i) + x2·(2(p-1)/p·n_i/t_i); normal equations of the 2x2 system
    rows = [(2 * (p - 1) / t, 2 * (p - 1) / p * n / t) for n, t in zip(sizes, times)]
    s11 = sum(r[0] * r[0] for r in rows)
    s12 = sum(r[0] * r[1] for r in rows)
    s22 = sum(r[1] * r[1] for r in rows)
    b1, b2 = sum(r[0] for r in rows), sum(r[1] for r in rows)
    det = s11 * s22 - s12 * s12
    alpha = (b1 * s22 - b2 * s12) / det
    inv_beta = (s11 * b2 - s12 * b1) / det
    if alpha < 0:                       # refit the bandwidth alone
        alpha, inv_beta = 0.0, b2 / s22
    if not inv_beta > 0:
        raise ValueError("the times do not grow with the message size: no bandwidth to fit")
    return alpha, 1.0 / inv_beta
