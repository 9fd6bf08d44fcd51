"""How much of a KV cache holds nothing: contiguous preallocation against paging, measured.

A serving engine keeps the keys and values of every running request. How it hands out that memory
decides how many requests fit at once, and so how large the decode batch is (module 05: batch size
is what makes decoding efficient). This module serves a synthetic workload step by step under two
kinds of policy and counts, at every step, where the memory went.

**The workload** (:func:`workload`). Chat requests are long-tailed: most prompts and answers are
short, a few are long. Both lengths are drawn from log-normal distributions, shaped after the
ShareGPT conversations that the vLLM paper (Kwon et al., 2023) serves (mean prompt about 161
tokens, mean output about 338):

- prompt length: median 100 tokens, log-space sigma 1.0 (mean 165; 90 % of prompts between 19
  and 520 tokens, about one in a hundred above 1000);
- output length: median 220 tokens, log-space sigma 0.9 (mean 330; 90 % between 50 and 960);
- every request also carries ``max_tokens``, the output limit a client sends (1024 by default,
  less when the prompt leaves less room): an output that would run longer is cut there, and
  ``prompt_len + max_tokens <= max_len``: 2048, the context of the OPT models the vLLM paper
  serves (SmolLM2's is 8192, where reserving the whole context would waste even more).

**The simulation** (:func:`simulate`). All requests wait in a queue at step 0. Each step (one
forward pass of the engine, iteration-level scheduling as in Orca and vLLM):

1. every running request that was admitted earlier writes the keys and values of one more token
   (a decode step);
2. waiting requests are admitted first come, first served, while memory allows (a newly admitted
   request writes its whole prompt: its prefill);
3. the step is measured;
4. requests that reached ``prompt_len + output_len`` positions leave and return their memory.

**The policies** (:data:`POLICIES`):

- ``"max_len"``: a contiguous slab of ``max_len`` positions per request, reserved on admission
  (what a static-batching server does: it cannot know how long an answer will get);
- ``"max_tokens"``: a contiguous slab of ``prompt_len + max_tokens`` positions;
- ``"exact"``: a contiguous slab of exactly ``prompt_len + output_len`` positions, an oracle no
  server has (the output length is unknown until the model stops); it shows what contiguity costs
  even with perfect knowledge;
- ``"paged"``: blocks of ``block_size`` positions (16) from the real
  :class:`llmu.paged.BlockManager`, taken one at a time as a request grows. Admission keeps 1 % of
  the blocks free (vLLM's watermark); when a running request needs a block and none is free, the
  most recently admitted request is *preempted*: its blocks are freed and it goes back to the
  front of the queue, to recompute its keys and values when readmitted (vLLM's recomputation).

Contiguous slabs live in one linear address space of ``budget`` positions, placed first-fit.

**What is counted** at each step, in positions (token slots; multiply by the bytes per token,
46 080 for SmolLM2 in float32, for bytes):

- ``allocated``: positions reserved by running requests (slabs, or blocks x block_size);
- ``used``: positions whose keys and values exist (the sum of the running requests' lengths);
- ``reservation``: allocated positions the request *will* fill later (contiguous only);
- ``internal``: allocated positions it never fills: the unused tail of a slab (``reserve - final
  length``), or of a request's last block (paged; we count the whole tail, although the next few
  tokens may still fill part of it);
- ``external``: free memory that cannot be used because it is cut into holes: counted as all the
  free positions at a step where the first waiting request would fit in the total free memory but
  in no single hole (paged: always 0, any free block serves any request).

Fractions are of ``held = allocated + external``, the memory the cache keeps from other uses;
``waste = reservation + internal + external``. Averages over the steps are time averages (the sum
over steps of each count, over the number of steps), so a fraction "averaged over the steps" is
``sum(wasted) / sum(held)``. The peak is the step that holds the most memory.

Everything is deterministic for a seed; results are plain dataclasses (:class:`Simulation`,
:class:`Memory`, :class:`Step`) that :func:`table` and :func:`text_table` turn into rows and :func:`figure` /
:func:`timeline` into plotly figures.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from llmu.paged.block_manager import BlockManager

__all__ = ["Request", "workload", "POLICIES", "POLICY_LABELS", "Memory", "Step", "Simulation", "simulate",
           "compare", "table", "text_table", "figure", "timeline", "MAX_LEN", "BUDGET", "BLOCK_SIZE"]

#: The longest a request can get (the vLLM paper's OPT models; SmolLM2 itself allows 8192).
MAX_LEN = 2048
#: Default memory budget in positions: 8 sequences of MAX_LEN (755 MB of SmolLM2 cache in float32).
BUDGET = 8 * MAX_LEN
#: Positions per block of the paged policy.
BLOCK_SIZE = 16

POLICIES = ("max_len", "max_tokens", "exact", "paged")
POLICY_LABELS = {
    "max_len": "contiguous, max_len reserved",
    "max_tokens": "contiguous, prompt + max_tokens",
    "exact": "contiguous, exact length (oracle)",
    "paged": "paged, blocks of {block_size}",
}


# ----------------------------------------------------------------------------------------------
# The workload
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One request: ``prompt_len`` tokens in, ``output_len`` tokens out (``<= max_tokens``)."""

    id: int
    prompt_len: int
    output_len: int
    max_tokens: int

    @property
    def total_len(self) -> int:
        """Positions the request holds when it finishes."""
        return self.prompt_len + self.output_len


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def workload(n: int = 64, seed: int = 0, *, max_len: int = MAX_LEN, max_tokens: int = 1024,
             prompt_median: float = 100.0, prompt_sigma: float = 1.0,
             output_median: float = 220.0, output_sigma: float = 0.9) -> list[Request]:
    """``n`` chat-like requests with log-normal prompt and output lengths (see the module docstring).

    Lengths are ``round(median * exp(sigma * z))`` with ``z`` standard normal, at least 1; a prompt
    is cut to ``max_len - 1`` tokens, the client's limit is ``min(max_tokens, max_len - prompt)``,
    and the output is cut to that limit. The same ``seed`` gives the same requests.
    """
    _positive_int("n", n)
    _positive_int("max_len", max_len)
    _positive_int("max_tokens", max_tokens)
    if max_len < 2:
        raise ValueError(f"max_len must leave room for a prompt and an output token, got {max_len}")
    for name, value in (("prompt_median", prompt_median), ("output_median", output_median)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    for name, value in (("prompt_sigma", prompt_sigma), ("output_sigma", output_sigma)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        prompt = min(max(1, round(rng.lognormvariate(math.log(prompt_median), prompt_sigma))), max_len - 1)
        limit = min(max_tokens, max_len - prompt)
        output = min(max(1, round(rng.lognormvariate(math.log(output_median), output_sigma))), limit)
        requests.append(Request(i, prompt, output, limit))
    return requests


# ----------------------------------------------------------------------------------------------
# What a step holds
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    """Positions held by the cache, split by what they hold (counts, or their averages over steps)."""

    allocated: float
    used: float
    reservation: float
    internal: float
    external: float

    @property
    def held(self) -> float:
        """Memory kept from other uses: allocated plus externally fragmented."""
        return self.allocated + self.external

    @property
    def wasted(self) -> float:
        return self.reservation + self.internal + self.external

    @property
    def waste_fraction(self) -> float:
        """``wasted / held`` (0 when nothing is held)."""
        return self.wasted / self.held if self.held else 0.0

    def fractions(self) -> dict[str, float]:
        """Used, reservation, internal and external as fractions of ``held`` (they sum to 1)."""
        h = self.held
        keys = ("used", "reservation", "internal", "external")
        return {k: (getattr(self, k) / h if h else 0.0) for k in keys}


@dataclass(frozen=True)
class Step(Memory):
    """One step of a simulation: its memory, and how many requests ran and waited."""

    step: int
    running: int
    waiting: int


@dataclass
class Simulation:
    """The result of :func:`simulate`: one :class:`Step` per engine step, and summaries."""

    policy: str
    budget: int
    block_size: int | None
    num_requests: int
    steps: list[Step] = field(default_factory=list)
    preemptions: int = 0  # paged: requests sent back to the queue to free their blocks
    finished: int = 0

    @property
    def label(self) -> str:
        return POLICY_LABELS[self.policy].format(block_size=self.block_size)

    @property
    def num_steps(self) -> int:
        """Steps until the last request finished (how long the workload took, in forward passes)."""
        return len(self.steps)

    @property
    def average(self) -> Memory:
        """Each count averaged over the steps (so ``average.waste_fraction`` is a time average)."""
        n = max(1, len(self.steps))
        return Memory(*(sum(getattr(s, f.name) for s in self.steps) / n for f in fields(Memory)))

    @property
    def peak(self) -> Step:
        """The step that held the most memory (the first such step)."""
        return max(self.steps, key=lambda s: s.held)

    @property
    def mean_running(self) -> float:
        return sum(s.running for s in self.steps) / max(1, len(self.steps))

    @property
    def max_running(self) -> int:
        return max((s.running for s in self.steps), default=0)

    def summary(self) -> dict:
        """One flat row: the averages, the peak, concurrency and length of the run."""
        avg, peak = self.average, self.peak
        row = {"policy": self.label, "steps": self.num_steps, "mean running": round(self.mean_running, 1),
               "max running": self.max_running, "preemptions": self.preemptions,
               "mean allocated": round(avg.allocated), "mean used": round(avg.used),
               "waste %": round(100 * avg.waste_fraction, 1)}
        for k, v in avg.fractions().items():
            if k != "used":
                row[f"{k} %"] = round(100 * v, 1)
        row.update({"peak allocated": peak.allocated, "peak used": peak.used,
                    "peak waste %": round(100 * peak.waste_fraction, 1)})
        return row


# ----------------------------------------------------------------------------------------------
# The simulation
# ----------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Running:
    key: int  # the request's index: its sequence id in the block manager (request ids may repeat)
    request: Request
    length: int  # positions whose keys and values exist
    reserve: int = 0  # contiguous: slab size
    start: int = 0  # contiguous: slab address

    @property
    def target(self) -> int:
        return self.request.total_len


class _Arena:
    """A linear address space of ``size`` positions with first-fit placement of slabs."""

    def __init__(self, size: int):
        self.size = size
        self.slabs: list[tuple[int, int]] = []  # (start, length), sorted by start

    def holes(self) -> list[int]:
        sizes, at = [], 0
        for start, length in self.slabs:
            sizes.append(start - at)
            at = start + length
        sizes.append(self.size - at)
        return [h for h in sizes if h > 0]

    def place(self, length: int) -> int | None:
        at = 0
        for i, (start, n) in enumerate(self.slabs):
            if start - at >= length:
                self.slabs.insert(i, (at, length))
                return at
            at = start + n
        if self.size - at >= length:
            self.slabs.append((at, length))
            return at
        return None

    def remove(self, start: int) -> None:
        self.slabs = [s for s in self.slabs if s[0] != start]


def _reserve(policy: str, r: Request, max_len: int) -> int:
    if policy == "max_len":
        return max_len
    if policy == "max_tokens":
        return r.prompt_len + r.max_tokens
    return r.total_len  # "exact"


def simulate(requests: Sequence[Request], policy: str, *, budget: int = BUDGET, max_len: int = MAX_LEN,
             block_size: int = BLOCK_SIZE, watermark: float = 0.01) -> Simulation:
    """Serve ``requests`` under ``policy`` (one of :data:`POLICIES`) in ``budget`` positions.

    ``block_size`` and ``watermark`` (the fraction of blocks admission keeps free) apply to the
    paged policy. Raises ValueError if a request can never fit (longer than ``max_len``, or than
    the whole budget).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    _positive_int("budget", budget)
    _positive_int("max_len", max_len)
    _positive_int("block_size", block_size)
    if not 0 <= watermark < 1:
        raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
    requests = list(requests)
    if not requests:
        raise ValueError("requests is empty: nothing to serve")
    for r in requests:
        if not isinstance(r, Request):
            raise TypeError(f"requests must be Request objects, got {type(r).__name__}")
        if r.total_len > max_len or r.prompt_len + r.max_tokens > max_len:
            raise ValueError(f"request {r.id} needs up to {r.prompt_len + r.max_tokens} positions, more than "
                             f"max_len={max_len}")
    paged = policy == "paged"
    sim = Simulation(policy, budget, block_size if paged else None, len(requests))
    if paged:
        bm = BlockManager(budget // block_size, block_size, prefix_caching=False) if budget >= block_size else None
        if bm is None or any(-(-r.total_len // block_size) > bm.num_blocks for r in requests):
            raise ValueError(f"a budget of {budget} positions cannot hold the longest request in blocks of "
                             f"{block_size}")
        keep_free = math.ceil(watermark * bm.num_blocks)
    else:
        arena = _Arena(budget)
        if any(_reserve(policy, r, max_len) > budget for r in requests):
            raise ValueError(f"a budget of {budget} positions cannot hold one reservation of policy {policy!r}")

    queue: deque[_Running] = deque(_Running(i, r, r.prompt_len) for i, r in enumerate(requests))
    running: list[_Running] = []
    step = 0

    def preempt(victim: _Running) -> None:
        bm.free(victim.key)
        running.remove(victim)
        queue.appendleft(victim)  # back to the front; readmitted with its length recomputed
        sim.preemptions += 1

    while queue or running:
        # 1. decode: running requests write one more token (paged: one more block now and then)
        for seq in list(running):
            if seq not in running:  # preempted earlier in this step
                continue
            if paged:
                while not bm.can_write(seq.key, seq.length, seq.length + 1):
                    preempt(running[-1])
                    if seq not in running:
                        break
                if seq not in running:
                    continue
                bm.prepare_write(seq.key, seq.length, seq.length + 1)
            seq.length += 1

        # 2. admission, first come first served, while the head of the queue fits
        while queue:
            seq = queue[0]
            if paged:
                need = bm.blocks_for(seq.length)
                if need > bm.num_free_blocks - (keep_free if running else 0):
                    break
                bm.allocate(seq.key, [0] * seq.length)
            else:
                seq.reserve = _reserve(policy, seq.request, max_len)
                start = arena.place(seq.reserve)
                if start is None:
                    break
                seq.start = start
            running.append(queue.popleft())
        if not running:  # cannot happen with the checks above; guards against an endless loop
            raise RuntimeError("no request could be admitted into an empty cache")

        # 3. measure
        used = sum(s.length for s in running)
        if paged:
            allocated = bm.num_used_blocks * block_size
            reservation, internal, external = 0, allocated - used, 0
        else:
            allocated = sum(s.reserve for s in running)
            reservation = sum(s.target - s.length for s in running)
            internal = sum(s.reserve - s.target for s in running)
            external = 0
            if queue:
                free, need = budget - allocated, _reserve(policy, queue[0].request, max_len)
                if need <= free and max(arena.holes(), default=0) < need:
                    external = free
        sim.steps.append(Step(allocated, used, reservation, internal, external, step, len(running), len(queue)))

        # 4. finished requests leave
        for seq in [s for s in running if s.length >= s.target]:
            running.remove(seq)
            sim.finished += 1
            if paged:
                bm.free(seq.key)
            else:
                arena.remove(seq.start)
        step += 1
    return sim


def compare(requests: Sequence[Request] | None = None, *, policies: Sequence[str] = POLICIES, budget: int = BUDGET,
            max_len: int = MAX_LEN, block_size: int = BLOCK_SIZE, watermark: float = 0.01) -> list[Simulation]:
    """:func:`simulate` for each policy on the same requests (the default :func:`workload`)."""
    requests = workload(max_len=max_len) if requests is None else list(requests)
    return [simulate(requests, p, budget=budget, max_len=max_len, block_size=block_size, watermark=watermark)
            for p in policies]


# ----------------------------------------------------------------------------------------------
# Tables and pictures
# ----------------------------------------------------------------------------------------------


def table(simulations: Sequence[Simulation]) -> list[dict]:
    """One :meth:`Simulation.summary` row per simulation."""
    return [s.summary() for s in simulations]


def text_table(simulations: Sequence[Simulation], columns: Sequence[str] | None = None) -> str:
    """:func:`table` as aligned text, one policy per row (for a notebook's output)."""
    rows = table(simulations)
    if not rows:
        return ""
    columns = list(columns) if columns is not None else list(rows[0])
    cells = [[str(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                                    for i, (v, w) in enumerate(zip(values, widths)))
    return "\n".join([line(columns), *(line(row) for row in cells)])


PARTS = {"used": "keys and values", "reservation": "reserved for future tokens",
         "internal": "internal fragmentation", "external": "external fragmentation"}


def figure(simulations: Sequence[Simulation], *, at: str = "average"):
    """Stacked bars: where the held memory goes under each policy (``at="average"`` or ``"peak"``)."""
    import plotly.graph_objects as go

    from llmu import viz

    if at not in ("average", "peak"):
        raise ValueError(f"at must be 'average' or 'peak', got {at!r}")
    labels = [s.label for s in simulations]
    mems = [s.average if at == "average" else s.peak for s in simulations]
    colors = {"used": viz.COLORS[2], "reservation": viz.COLORS[1], "internal": viz.COLORS[3], "external": "#999999"}
    fig = go.Figure()
    for part, name in PARTS.items():
        values = [100 * m.fractions()[part] for m in mems]
        fig.add_trace(go.Bar(y=labels, x=values, name=name, orientation="h", marker_color=colors[part],
                             text=[f"{v:.0f}%" if v >= 4 else "" for v in values], textposition="inside"))
    fig.update_layout(barmode="stack", legend=dict(orientation="h", y=-0.25))
    fig.update_yaxes(autorange="reversed")
    when = "averaged over the steps" if at == "average" else "at the peak step"
    return viz.style(fig, f"Where the KV cache memory goes ({when})", "% of the memory held", None, height=360)


def timeline(simulations: Sequence[Simulation]):
    """Allocated (solid) and used (dotted) positions at every step, one colour per policy."""
    import plotly.graph_objects as go

    from llmu import viz

    fig = go.Figure()
    for i, s in enumerate(simulations):
        color = viz.COLORS[i % len(viz.COLORS)]
        x = [st.step for st in s.steps]
        fig.add_trace(go.Scatter(x=x, y=[st.allocated for st in s.steps], name=f"{s.label}: allocated",
                                 line=dict(color=color)))
        fig.add_trace(go.Scatter(x=x, y=[st.used for st in s.steps], name=f"{s.label}: used",
                                 line=dict(color=color, dash="dot")))
    budget = simulations[0].budget if simulations else 0
    fig.add_hline(y=budget, line=dict(color="#000", width=1, dash="dash"), annotation_text="budget")
    fig.update_layout(legend=dict(orientation="h", y=-0.2, x=0))
    return viz.style(fig, "KV cache positions over time (solid: allocated, dotted: used)", "engine step",
                     "positions", height=600)
