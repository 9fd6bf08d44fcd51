"""The serving engine step by step: who ran, how many positions each, what was left of the pool.

An engine keeps no history: each :meth:`LLMEngine.step` schedules, runs and forgets. This module
writes the history down, one :class:`Step` per call of the scheduler:

- ``work``: the sequences the step computed, in the order they were packed, each with its *kind*
  (``"prefill"``: prompt positions, all at once or a chunk; ``"decode"``: the one token sampled
  last step; ``"recompute"``: a preempted sequence computing its prompt and its earlier output
  again), its first position and its number of positions, and whether the step reaches its last
  position (then its logits pick a token);
- the queue after scheduling (``waiting``), who finished and who was preempted at this step, the
  free blocks after it, the prompt positions the prefix cache supplied, and (for a real run) how
  long the step took.

Two ways to get one:

- :func:`record` runs a real :class:`~llmu.engine.LLMEngine` on a workload and watches its
  scheduler (the model runs, text is generated, steps are timed);
- :func:`simulate` drives the engine's own :class:`~llmu.engine.scheduler.Scheduler` and
  :class:`~llmu.paged.BlockManager` with *no model at all*: every sequence that reaches its last
  position gets a placeholder token. When requests ignore the end-of-sequence token (so that only
  ``max_tokens`` ends them), scheduling does not depend on which tokens come out, and the
  simulation reproduces a real run step for step in a few milliseconds: fast enough to redraw the
  picture while a slider moves.

Pictures: :func:`figure` shows one run, the sequences in each step (decoding, prefilling, idle
slots) above one lane per request coloured by what it does at each step (hover for details);
:func:`compare` puts the occupancy of several runs (static against continuous batching) one
above the other on a shared step axis. :func:`table` prints a run as text; :func:`summary`
counts it.

::

    steps = record(engine, prompts, SamplingParams(max_tokens=16))
    print(table(steps))
    figure(steps, max_num_seqs=4).show()
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence as SequenceABC
from contextlib import contextmanager
from dataclasses import dataclass, field

from llmu.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from llmu.engine.sequence import SamplingParams, Sequence, Status
from llmu.paged.block_manager import BlockManager

__all__ = ["Work", "Step", "record", "simulate", "summary", "table", "figure", "compare", "KINDS",
           "KIND_COLORS"]

#: What a sequence can do in a step (and ``"waiting"``: queued, holding no blocks).
KINDS = ("prefill", "decode", "recompute")
#: Colours of the kinds in the pictures (Okabe-Ito, as ``llmu.viz``), plus waiting and idle slots.
KIND_COLORS = {"decode": "#0072B2", "prefill": "#E69F00", "recompute": "#D55E00", "waiting": "#DDDDDD",
               "idle": "#F2F2F2"}
#: The token :func:`simulate` appends where a model would have sampled one.
PLACEHOLDER_TOKEN = 0


@dataclass(frozen=True)
class Work:
    """One sequence's share of a step."""

    request: int  # request id
    index: int  # which of the request's samples (0 unless n > 1)
    kind: str  # "prefill", "decode" or "recompute"
    start: int  # its first position computed in this step
    tokens: int  # positions computed in this step
    samples: bool  # the step reaches its last position: a token is sampled

    @property
    def label(self) -> str:
        return _label(self.request, self.index)

    def describe(self) -> str:
        """``"prefill 48 (0-47)"``, ``"decode @57"``."""
        if self.kind == "decode":
            return f"decode @{self.start}"
        return f"{self.kind} {self.tokens} ({self.start}-{self.start + self.tokens - 1})"


@dataclass
class Step:
    """One call of the scheduler and what followed (see the module docstring)."""

    index: int
    work: list[Work]
    waiting: list[str]  # labels of the queued sequences after scheduling, front first
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    free_blocks: int = 0  # after the step
    num_blocks: int = 0
    cached_tokens: int = 0  # prompt positions of sequences admitted now that the prefix cache held
    seconds: float | None = None  # wall time of the step (record only)

    @property
    def running(self) -> int:
        """Sequences computed in this step."""
        return len(self.work)

    @property
    def num_tokens(self) -> int:
        """Positions computed in this step (the forward pass's packed length)."""
        return sum(w.tokens for w in self.work)

    @property
    def prefill_tokens(self) -> int:
        """Positions of prompts (and of recomputation) in this step."""
        return sum(w.tokens for w in self.work if w.kind != "decode")

    @property
    def decode_tokens(self) -> int:
        return sum(w.tokens for w in self.work if w.kind == "decode")

    @property
    def sampled(self) -> int:
        """Sequences that got a token at this step."""
        return sum(1 for w in self.work if w.samples)

    def key(self) -> tuple:
        """Everything but the timing: two runs that scheduled alike have equal keys."""
        return (tuple(self.work), tuple(self.waiting), tuple(self.finished), tuple(self.preempted),
                self.free_blocks, self.cached_tokens)


def _label(request: int, index: int) -> str:
    return f"r{request}" if index == 0 else f"r{request}.{index}"


def _seq_label(seq: Sequence) -> str:
    return _label(seq.request_id, seq.index)


def _work(seq: Sequence, n: int) -> Work:
    """What ``seq`` does with ``n`` positions, judged before the step runs (``num_computed`` is its start)."""
    start = seq.num_computed
    if seq.num_output_tokens > 0 and start == seq.num_tokens - 1 and n == 1:
        kind = "decode"
    elif seq.preemptions > 0:
        kind = "recompute"
    else:
        kind = "prefill"
    return Work(seq.request_id, seq.index, kind, start, n, start + n == seq.num_tokens)


def _snapshot(batch: ScheduledBatch) -> tuple[list[Work], list[Sequence], list[str], int]:
    return ([_work(seq, n) for seq, n in batch.entries], [seq for seq, _ in batch.entries],
            [_seq_label(s) for s in batch.preempted], batch.cached_tokens)


@contextmanager
def _watching(scheduler: Scheduler, sink: list):
    """Wrap ``scheduler.schedule`` so that every batch it returns is noted in ``sink`` first."""
    original = scheduler.schedule

    def schedule() -> ScheduledBatch:
        batch = original()
        sink.append(_snapshot(batch))
        return batch

    scheduler.schedule = schedule
    try:
        yield
    finally:
        del scheduler.schedule  # the class's method again


def _prompts_and_params(prompts, sampling_params) -> tuple[list, list]:
    if isinstance(prompts, str) or not isinstance(prompts, SequenceABC) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (texts, chat conversations or token-id lists)")
    prompts = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return prompts, [sampling_params or SamplingParams()] * len(prompts)
    params = list(sampling_params)
    if len(params) != len(prompts):
        raise ValueError(f"sampling_params: give one SamplingParams or one per prompt ({len(prompts)}), "
                         f"got {len(params)}")
    return prompts, params


def record(engine, prompts, sampling_params=None, *, max_steps: int = 10_000) -> list[Step]:
    """Add ``prompts`` to ``engine`` and run it until every request is done, one :class:`Step` per
    scheduling. ``sampling_params``: one :class:`SamplingParams` for all, or one per prompt.

    Requests the engine already held are run (and recorded) too. Raises ``RuntimeError`` after
    ``max_steps`` steps (a workload that never ends is a bug worth hearing about).
    """
    prompts, params = _prompts_and_params(prompts, sampling_params)
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    sched, bm = engine.scheduler, engine.block_manager
    seen: list = []
    steps: list[Step] = []
    with _watching(sched, seen):
        while engine.has_unfinished():
            if len(steps) >= max_steps:
                raise RuntimeError(f"the engine did not finish within max_steps={max_steps} steps")
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            work, seqs, preempted, cached = seen.pop()
            steps.append(Step(len(steps), work, [_seq_label(s) for s in sched.waiting],
                              [_seq_label(s) for s in seqs if s.status is Status.FINISHED], preempted,
                              bm.num_free_blocks, bm.num_blocks, cached, seconds))
    return steps


def simulate(prompts, max_tokens, *, num_blocks: int, block_size: int = 16, max_num_seqs: int = 32,
             max_num_batched_tokens: int = 512, chunked_prefill: bool = True, prefix_caching: bool = True,
             policy: str = "continuous", reserve: str = "blocks", max_model_len: int = 2048,
             max_steps: int = 10_000) -> list[Step]:
    """The engine's scheduling of a workload, without a model.

    ``prompts``: token-id lists, or prompt lengths (ints: request ``r`` then gets distinct made-up
    ids, so no two prompts share a block). ``max_tokens``: new tokens per request, one int for all
    or one per prompt; every request runs to exactly that many (the end-of-sequence token is
    ignored, as with ``SamplingParams(ignore_eos=True)``). The other arguments are the engine's
    (see :class:`~llmu.engine.LLMEngine`). A request the engine would refuse raises ``ValueError``.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, SequenceABC) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists or prompt lengths")
    ids: list[list[int]] = []
    for r, p in enumerate(prompts):
        if isinstance(p, bool) or not isinstance(p, (int, SequenceABC)) or isinstance(p, str):
            raise TypeError(f"prompts[{r}] must be a prompt length or a list of token ids, got {p!r}")
        if isinstance(p, int):
            if p < 1:
                raise ValueError(f"prompts[{r}]: a prompt needs at least one token, got length {p}")
            ids.append([100_000 * (r + 1) + j for j in range(p)])
        else:
            if not p:
                raise ValueError(f"prompts[{r}] is empty: a prompt needs at least one token")
            ids.append(list(p))
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        max_tokens = [max_tokens] * len(ids)
    max_tokens = list(max_tokens)
    if len(max_tokens) != len(ids):
        raise ValueError(f"max_tokens: give one int or one per prompt ({len(ids)}), got {len(max_tokens)}")
    bm = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             chunked_prefill=chunked_prefill, policy=policy, reserve=reserve,
                             max_model_len=max_model_len)
    sched = Scheduler(config, bm)
    for r, (p, m) in enumerate(zip(ids, max_tokens)):
        params = SamplingParams(max_tokens=m, ignore_eos=True)  # validates max_tokens
        # the engine's admission rules (LLMEngine.add_request): refuse what could never run
        need = len(p) + m
        if need > max_model_len:
            raise ValueError(f"prompts[{r}]: {len(p)} prompt tokens + max_tokens {m} = {need} positions, "
                             f"more than max_model_len={max_model_len}")
        reserve_tokens = max_model_len if reserve == "context" else need
        if bm.blocks_for(reserve_tokens) + 1 > num_blocks:
            raise ValueError(f"prompts[{r}]: needs up to {bm.blocks_for(reserve_tokens)} blocks, the pool has "
                             f"{num_blocks} (one kept spare)")
        if not chunked_prefill and len(p) > max_num_batched_tokens:
            raise ValueError(f"prompts[{r}]: {len(p)} tokens do not fit one step of max_num_batched_tokens="
                             f"{max_num_batched_tokens} without chunked_prefill")
        sched.add(Sequence(r, 0, list(p), len(p), params))
    steps: list[Step] = []
    while sched.has_unfinished():
        if len(steps) >= max_steps:
            raise RuntimeError(f"the scheduler did not finish within max_steps={max_steps} steps")
        batch = sched.schedule()
        if not batch and not batch.preempted:
            raise RuntimeError("the scheduler found nothing to run although requests remain")
        work, seqs, preempted, cached = _snapshot(batch)
        sched.computed(batch)
        finished = []
        for seq in seqs:  # what the engine's step does after the forward pass, minus the model
            if seq.num_computed == seq.num_tokens:
                seq.token_ids.append(PLACEHOLDER_TOKEN)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, "length")
                    finished.append(_seq_label(seq))
        steps.append(Step(len(steps), work, [_seq_label(s) for s in sched.waiting], finished, preempted,
                          bm.num_free_blocks, bm.num_blocks, cached))
    return steps


def summary(steps: SequenceABC[Step]) -> dict:
    """Counts of a run: steps, forward passes, positions computed (prefill, decode), tokens sampled,
    sequences per step (mean and peak), preemptions, prefix-cached positions, seconds (record only)."""
    passes = [s for s in steps if s.work]
    seconds = [s.seconds for s in steps if s.seconds is not None]
    return {
        "steps": len(steps),
        "forward_passes": len(passes),
        "prefill_tokens": sum(s.prefill_tokens for s in steps),
        "decode_tokens": sum(s.decode_tokens for s in steps),
        "sampled_tokens": sum(s.sampled for s in steps),
        "mean_running": sum(s.running for s in passes) / len(passes) if passes else 0.0,
        "peak_running": max((s.running for s in steps), default=0),
        "preemptions": sum(len(s.preempted) for s in steps),
        "cached_tokens": sum(s.cached_tokens for s in steps),
        "seconds": sum(seconds) if seconds else None,
    }


def table(steps: SequenceABC[Step], *, width: int = 60) -> str:
    """The run as text, one line per step: sequences, prefill and decode positions, free blocks,
    then what each sequence did, who waits, and who finished (``width`` cuts the long columns)."""
    def cut(text: str) -> str:
        return text if len(text) <= width else text[: width - 3] + "..."

    timed = any(s.seconds is not None for s in steps)
    head = f"{'step':>4} {'seqs':>4} {'prefill':>7} {'decode':>6} {'free':>5}" + (f" {'ms':>6}" if timed else "")
    lines = [head + "  work / waiting / finished"]
    for s in steps:
        line = f"{s.index:>4} {s.running:>4} {s.prefill_tokens:>7} {s.decode_tokens:>6} {s.free_blocks:>5}"
        if timed:
            line += f" {s.seconds * 1000:>6.0f}" if s.seconds is not None else f" {'':>6}"
        work = ", ".join(f"{w.label} {w.describe()}" for w in s.work) or "(nothing ran)"
        extra = []
        if s.preempted:
            extra.append("preempted " + " ".join(s.preempted))
        if s.cached_tokens:
            extra.append(f"{s.cached_tokens} prompt positions from the prefix cache")
        if s.waiting:
            extra.append("waiting " + " ".join(s.waiting))
        if s.finished:
            extra.append("finished " + " ".join(s.finished))
        lines.append(line + "  " + cut(work) + ("; " + cut("; ".join(extra)) if extra else ""))
    return "\n".join(lines)


def _check_steps(steps, name: str = "steps") -> list[Step]:
    if isinstance(steps, Step) or not isinstance(steps, SequenceABC) or not all(isinstance(s, Step) for s in steps):
        raise TypeError(f"{name} must be a list of timeline.Step (from record or simulate)")
    if not steps:
        raise ValueError(f"{name} is empty: nothing to draw")
    return list(steps)


def _check_slots(max_num_seqs) -> None:
    if max_num_seqs is not None and (isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int)
                                     or max_num_seqs < 1):
        raise ValueError(f"max_num_seqs must be a positive int or None, got {max_num_seqs!r}")


def _occupancy_traces(steps: list[Step], max_num_seqs: int | None, legend: bool, group: str = ""):
    """Stacked bars of one run: sequences decoding, prefilling (or recomputing), idle slots."""
    import plotly.graph_objects as go

    x = [s.index for s in steps]
    hover = []
    for s in steps:
        lines = [f"step {s.index}: {s.running} sequence(s), {s.num_tokens} positions"]
        lines += [f"{w.label}: {w.describe()}" + (" → token" if w.samples else "") for w in s.work[:12]]
        if len(s.work) > 12:
            lines.append(f"... and {len(s.work) - 12} more")
        lines.append(f"free blocks after: {s.free_blocks} of {s.num_blocks}")
        if s.waiting:
            lines.append(f"waiting: {len(s.waiting)}")
        hover.append("<br>".join(lines))
    series = [("decode", [sum(1 for w in s.work if w.kind == "decode") for s in steps]),
              ("prefill", [sum(1 for w in s.work if w.kind == "prefill") for s in steps]),
              ("recompute", [sum(1 for w in s.work if w.kind == "recompute") for s in steps])]
    if max_num_seqs is not None:
        series.append(("idle", [max(0, max_num_seqs - s.running) for s in steps]))
    traces = []
    for name, ys in series:
        if name == "recompute" and not any(ys):
            continue
        traces.append(go.Bar(x=x, y=ys, name="idle slot" if name == "idle" else name,
                             marker_color=KIND_COLORS[name], hovertext=hover, hoverinfo="text",
                             legendgroup=name + group, showlegend=legend))
    return traces


def _count_ticks(steps: list[Step], max_num_seqs: int | None) -> dict:
    """Whole-number ticks on a sequence-count axis (plotly would show 0.5 steps for small counts)."""
    top = max([s.running for s in steps] + [max_num_seqs or 0])
    return {"dtick": 1, "rangemode": "tozero"} if top <= 10 else {"rangemode": "tozero"}


def _lanes(steps: list[Step]):
    """One row per sequence: a state code per step (None outside its life) and the hover texts."""
    order: list[str] = []
    for s in steps:
        for label in [w.label for w in s.work] + list(s.waiting):
            if label not in order:
                order.append(label)
    order.sort(key=lambda lab: tuple(int(p) for p in lab[1:].split(".")))
    code = {"waiting": 0, "prefill": 1, "decode": 2, "recompute": 3}
    z = {lab: [None] * len(steps) for lab in order}
    text = {lab: [""] * len(steps) for lab in order}
    for i, s in enumerate(steps):
        for lab in s.waiting:
            z[lab][i], text[lab][i] = code["waiting"], f"{lab} · step {s.index}: waiting"
        for w in s.work:
            z[w.label][i] = code[w.kind]
            text[w.label][i] = (f"{w.label} · step {s.index}: {w.describe()}" + (" → samples a token" if w.samples
                                else "") + (" · finished" if w.label in s.finished else ""))
    return order, z, text


def figure(steps: SequenceABC[Step], *, max_num_seqs: int | None = None, title: str | None = None,
           max_steps: int | None = None):
    """One run: the sequences of each step (stacked: decoding, prefilling, recomputing, idle slots
    up to ``max_num_seqs``), and below one lane per request, coloured by what it does at each
    step (grey: waiting in the queue; blank: not yet arrived or done). ``max_steps`` fixes the
    step axis (to line up two runs). Hover over a bar or a cell for the details."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from llmu import viz

    steps = _check_steps(steps)
    _check_slots(max_num_seqs)
    order, z, text = _lanes(steps)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.06, row_heights=[0.35, 0.65])
    for trace in _occupancy_traces(steps, max_num_seqs, legend=True):
        fig.add_trace(trace, 1, 1)
    colors = [KIND_COLORS[k] for k in ("waiting", "prefill", "decode", "recompute")]
    scale = []
    for i, c in enumerate(colors):  # codes 0..3 -> one flat colour band each
        scale += [[i / 4, c], [(i + 1) / 4, c]]
    fig.add_trace(go.Heatmap(x=[s.index for s in steps], y=order, z=[z[lab] for lab in order],
                             text=[text[lab] for lab in order], hoverinfo="text", zmin=-0.5, zmax=3.5,
                             colorscale=scale, showscale=False, xgap=1, ygap=2, hoverongaps=False), 2, 1)
    fig.add_trace(go.Bar(x=[None], y=[None], name="waiting", marker_color=KIND_COLORS["waiting"],
                         legendgroup="waiting", hoverinfo="skip"), 1, 1)
    s = summary(steps)
    default = (f"{s['steps']} steps, {s['mean_running']:.1f} sequences per step on average"
               + (f" (of {max_num_seqs} slots)" if max_num_seqs else "")
               + (f", {s['preemptions']} preemption(s)" if s["preemptions"] else ""))
    viz.style(fig, title or default, height=max(420, 240 + 22 * len(order)))
    fig.update_layout(barmode="stack", bargap=0.1)
    fig.update_yaxes(title_text="sequences", row=1, col=1, **_count_ticks(steps, max_num_seqs))
    fig.update_yaxes(autorange="reversed", row=2, col=1, title_text="request")
    fig.update_xaxes(title_text="step", row=2, col=1)
    if max_steps is not None:
        fig.update_xaxes(range=[-0.5, max_steps - 0.5])
    return fig


def compare(traces: Mapping[str, SequenceABC[Step]], *, max_num_seqs: int | None = None, title: str | None = None):
    """The occupancy of several runs (``{"name": steps}``), one above the other on a shared step
    axis, each titled with its steps and mean sequences per step."""
    from plotly.subplots import make_subplots

    from llmu import viz

    if not isinstance(traces, Mapping) or not traces:
        raise ValueError("traces must be a non-empty dict {name: steps}")
    runs = {name: _check_steps(steps, f"traces[{name!r}]") for name, steps in traces.items()}
    _check_slots(max_num_seqs)
    titles = []
    for name, steps in runs.items():
        s = summary(steps)
        sec = f", {s['seconds']:.1f} s" if s["seconds"] is not None else ""
        titles.append(f"{name}: {s['steps']} steps, {s['mean_running']:.1f} sequences per step{sec}")
    fig = make_subplots(rows=len(runs), cols=1, shared_xaxes=True, vertical_spacing=0.12, subplot_titles=titles)
    for row, steps in enumerate(runs.values(), start=1):
        for trace in _occupancy_traces(steps, max_num_seqs, legend=row == 1, group=""):
            fig.add_trace(trace, row, 1)
        fig.update_yaxes(title_text="sequences", row=row, col=1, **_count_ticks(steps, max_num_seqs))
    viz.style(fig, title or "sequences in each step", height=160 + 200 * len(runs))
    fig.update_layout(barmode="stack", bargap=0.1)
    fig.update_xaxes(title_text="step", row=len(runs), col=1)
    return fig
