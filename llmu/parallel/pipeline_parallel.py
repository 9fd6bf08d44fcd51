"""Pipeline parallelism: the layers of a model split into ``p`` stages, one per rank, fed micro-batches.

A model too deep for one device can be cut into ``p`` consecutive *stages*: rank 0 holds the
embedding and the first blocks, rank ``p - 1`` the last blocks, the LM head and the loss. A
forward pass travels down the ranks (each sends its output activation to the next, with a
point-to-point ``send``), the backward pass travels back up (each sends the gradient of its input
to the previous one). Done on the whole batch, only one rank works at a time. Cut the batch into
``m`` *micro-batches* instead, and rank 0 starts micro-batch 1 while rank 1 works on micro-batch 0:
the ranks overlap, and the gradients, accumulated over the micro-batches, are the whole batch's.

**Schedules.** The order in which a rank runs its ``m`` forwards (``F``) and ``m`` backwards (``B``)
is its *schedule*; here a plain list of actions that a learner can print (:func:`format_schedule`):

- **GPipe** (Huang et al., 2019): all ``m`` forwards, then all ``m`` backwards. A rank keeps the
  activations of all ``m`` micro-batches alive until their backward.
- **1F1B** (PipeDream-Flush, Narayanan et al., 2021): rank ``r`` runs ``w = min(p - r - 1, m)``
  *warm-up* forwards, then alternates one forward and one backward (the *steady state*), then
  runs the ``w`` remaining backwards (the *cool-down*). At most ``min(p - r, m)`` micro-batches
  are in flight on rank ``r`` (forward done, backward not yet), whatever ``m`` is.

Both schedules do the same work in the same dependency order, so they leave the same *bubble*:
with equal per-micro-batch costs ``t_f`` and ``t_b`` on every stage, the pipeline takes
``(m + p - 1)(t_f + t_b)`` while each rank is busy ``m (t_f + t_b)`` of it, an idle fraction of

    bubble = (p - 1) / (m + p - 1).

More micro-batches shrink it; 1F1B's gain is memory (``p - r`` activations instead of ``m``),
which is what lets ``m`` grow. :func:`ideal_timeline` computes the timeline those costs give.

**The runner.** :func:`pipeline_step` executes one training step of a schedule on real
``torch.distributed`` processes: activations and gradients travel with ``dist.isend`` /
``dist.recv``. Sends are non-blocking on purpose: under gloo a blocking ``send`` returns only once
the peer has posted the matching receive, and in 1F1B's steady state rank ``r`` sends an
activation down while rank ``r + 1`` sends a gradient up; two blocking sends facing each other
would wait forever. Receives block: waiting for a peer *is* the bubble. The last stage divides
each micro-batch's loss (a mean over that micro-batch) by ``m``, so the accumulated gradients
equal those of the mean loss over the whole batch, as single-process training computes them.

**Measurement.** Every rank records a timeline: the start and end of each action (``F``, ``B``,
``recv_act``, ``send_act``, ``recv_grad``, ``send_grad``), in seconds after a common start (a
barrier). A rank's bubble is ``1 - busy / makespan``: ``busy`` the time in its ``F`` and ``B``
actions, ``makespan`` the time until the last rank finished (a ``MAX`` all-reduce). It also
records the peak number of micro-batches in flight (their activations kept for the backward).

On a CPU with gloo the measured bubble drifts from the formula for two reasons: every action
carries fixed costs (Python, the autograd engine, a gloo message and the wake-up of the process
that waits for it: tens to hundreds of microseconds, milliseconds on a loaded machine), and ``p``
processes on fewer cores slow each other down exactly when they all compute (the steady state),
not when some wait (fill and drain), which inflates the busy time and hides the bubble. A GPU
stage has a device of its own, and its host thread waits while the device computes. The runner
models that with ``forward_s`` / ``backward_s``: after the real computation of ``F`` (``B``) the
rank sleeps until the action has lasted ``forward_s`` (``backward_s``), an equal, calibrated
per-micro-batch cost on every stage that does not compete for cores. The gradients stay real:
each action computes first, then sleeps what is left of its cost.

``llmu bench pipeline_bubble`` measures it (one-layer stages of a tiny Llama, ``forward_s`` =
20 ms, ``backward_s`` = 40 ms, ``p`` in {2, 4}, ``m`` in {1, 4, 8}, both schedules) beside the load
average: on a 2-core machine the measured bubble lay 0.00 to 0.06 above the formula at load 3 to 4
and up to 0.11 above it at load 5.6 (the fixed per-action costs lengthen the makespan beyond
``(m + p - 1)(t_f + t_b)``, more so on a busy machine). With real compute alone (four layers per stage, no sleep) it lies 0.1
to 0.2 above the formula and differs from rank to rank: ``F + B`` of one micro-batch took 17 to
53 ms depending on the rank and on how many ranks computed at once.

Not covered: interleaved (virtual-stage) schedules, zero-bubble schedules, tied embeddings
across the first and last stage (they would need a gradient all-reduce between those two ranks),
and activation recomputation.

Example (in a ``.py`` file or a notebook)::

    from llmu.distributed import launch
    from llmu.parallel.pipeline_parallel import demo, timeline_figure
    results = launch(demo, 4, "1f1b", 8)
    timeline_figure([r["timeline"] for r in results])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmu.checks import require_positive

__all__ = ["SCHEDULES", "Action", "Event", "compute_order", "stage_actions", "format_schedule",
           "check_schedule", "ideal_timeline", "theoretical_bubble", "theoretical_peak_in_flight",
           "bubble_fraction", "measured_bubble", "split_blocks", "sequential_stages", "LlamaStage",
           "llama_stages", "causal_lm_loss", "PipelineResult", "pipeline_step", "timeline_figure", "demo"]

#: The schedules :func:`compute_order` knows.
SCHEDULES = ("gpipe", "1f1b")

#: Compute actions and the point-to-point messages around them.
COMPUTE_OPS = ("F", "B")
COMM_OPS = ("recv_act", "send_act", "recv_grad", "send_grad")


class Action(NamedTuple):
    """One step of a rank's schedule: ``op`` (``"F"``, ``"B"`` or a message) on ``micro_batch``."""

    op: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.op}{self.micro_batch}" if self.op in COMPUTE_OPS else f"{self.op}({self.micro_batch})"


class Event(NamedTuple):
    """One action as it ran: ``start`` and ``end`` in seconds after the common start."""

    op: str
    micro_batch: int
    start: float
    end: float


# ----------------------------------------------------------------------------------------------
# Schedules: plain lists of actions
# ----------------------------------------------------------------------------------------------


def _check_sizes(num_stages, micro_batches, rank=None) -> None:
    require_positive("num_stages", num_stages, integer=True)
    require_positive("micro_batches", micro_batches, integer=True)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_stages):
        raise ValueError(f"rank must be an int in [0, num_stages={num_stages}), got {rank!r}")


def _check_schedule_name(schedule) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def compute_order(schedule: str, num_stages: int, micro_batches: int, rank: int) -> list[Action]:
    """Rank ``rank``'s forwards and backwards, in the order it runs them.

    ``"gpipe"``: ``F0 .. F(m-1)``, then ``B0 .. B(m-1)``. ``"1f1b"``: ``w = min(p - rank - 1, m)``
    warm-up forwards, then ``m - w`` pairs ``F(w + i), B(i)``, then the last ``w`` backwards.
    """
    _check_schedule_name(schedule)
    _check_sizes(num_stages, micro_batches, rank)
    m = micro_batches
    forwards = [Action("F", i) for i in range(m)]
    backwards = [Action("B", i) for i in range(m)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(num_stages - rank - 1, m)
    order = forwards[:warmup]                          # warm-up: fill the pipeline below this rank
    for i in range(m - warmup):                        # steady state: one forward, one backward
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[m - warmup:]              # cool-down: drain it


def stage_actions(schedule: str, num_stages: int, micro_batches: int, rank: int) -> list[Action]:
    """:func:`compute_order` with the messages around each action, what :func:`pipeline_step` runs.

    ``F i``: receive micro-batch ``i``'s activation from ``rank - 1`` (not on the first stage),
    compute, send the output to ``rank + 1`` (not on the last). ``B i``: receive the gradient of
    that output from ``rank + 1`` (not on the last stage), backward, send the gradient of the
    input to ``rank - 1`` (not on the first).
    """
    first, last = rank == 0, rank == num_stages - 1
    actions = []
    for op, i in compute_order(schedule, num_stages, micro_batches, rank):
        if op == "F":
            actions += ([] if first else [Action("recv_act", i)]) + [Action("F", i)] + \
                ([] if last else [Action("send_act", i)])
        else:
            actions += ([] if last else [Action("recv_grad", i)]) + [Action("B", i)] + \
                ([] if first else [Action("send_grad", i)])
    return actions


def format_schedule(schedule: str, num_stages: int, micro_batches: int, messages: bool = False) -> str:
    """The schedule of every rank, one line each (``messages=True`` shows the sends and receives)::

        >>> print(format_schedule("1f1b", 2, 3))
        rank 0: F0 F1 B0 F2 B1 B2
        rank 1: F0 B0 F1 B1 F2 B2
    """
    build = stage_actions if messages else compute_order
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in build(schedule, num_stages, micro_batches, r))
                     for r in range(num_stages))


def ideal_timeline(orders: Sequence[Sequence[Action]], forward: float = 1.0,
                   backward: float = 2.0) -> list[list[Event]]:
    """The timeline that per-rank compute orders give with equal costs and free messages.

    ``orders[r]``: rank ``r``'s ``F``/``B`` actions (:func:`compute_order`). Every ``F`` takes
    ``forward``, every ``B`` ``backward``; a rank runs its actions in order, each as soon as its
    input is there (``F i`` on rank ``r`` needs ``F i`` of rank ``r - 1``, ``B i`` needs ``B i`` of
    rank ``r + 1``, and on the last rank its own ``F i``), as :func:`pipeline_step` does with
    blocking receives. Raises ``ValueError`` when the orders deadlock (no rank can go on).
    """
    p = len(orders)
    forward_end: list[dict[int, float]] = [{} for _ in range(p)]
    backward_end: list[dict[int, float]] = [{} for _ in range(p)]
    clocks, done = [0.0] * p, [0] * p
    timelines: list[list[Event]] = [[] for _ in range(p)]
    while any(done[r] < len(orders[r]) for r in range(p)):
        progress = False
        for r in range(p):
            while done[r] < len(orders[r]):
                op, i = orders[r][done[r]]
                if op == "F":
                    ready = 0.0 if r == 0 else forward_end[r - 1].get(i)
                elif op == "B":
                    ready = forward_end[r].get(i) if r == p - 1 else backward_end[r + 1].get(i)
                else:
                    raise ValueError(f"orders[{r}] holds {op!r}: only 'F' and 'B' actions")
                if ready is None:      # blocked on a message that has not been sent yet
                    break
                start = max(clocks[r], ready)
                clocks[r] = start + (forward if op == "F" else backward)
                (forward_end if op == "F" else backward_end)[r][i] = clocks[r]
                timelines[r].append(Event(op, i, start, clocks[r]))
                done[r] += 1
                progress = True
        if not progress:
            stuck = {r: str(orders[r][done[r]]) for r in range(p) if done[r] < len(orders[r])}
            raise ValueError(f"the schedule deadlocks: each rank waits for a message that never comes "
                             f"(rank: blocked action) {stuck}")
    return timelines


def check_schedule(orders: Sequence[Sequence[Action]], micro_batches: int) -> None:
    """Raise ``ValueError`` unless every rank runs ``F i`` and ``B i`` once for each of the
    ``micro_batches`` micro-batches, each ``F i`` before its ``B i``, and the ranks do not deadlock."""
    require_positive("micro_batches", micro_batches, integer=True)
    for r, order in enumerate(orders):
        for op in COMPUTE_OPS:
            seen = sorted(i for o, i in order if o == op)
            if seen != list(range(micro_batches)):
                raise ValueError(f"rank {r} must run {op} once for each micro-batch 0..{micro_batches - 1}, "
                                 f"got {op} for {seen}")
        position = {a: k for k, a in enumerate(order)}
        for i in range(micro_batches):
            if position[Action("B", i)] < position[Action("F", i)]:
                raise ValueError(f"rank {r} runs B{i} before F{i}")
    ideal_timeline(orders)


def theoretical_bubble(num_stages: int, micro_batches: int) -> float:
    """``(p - 1) / (m + p - 1)``: the idle fraction of GPipe and 1F1B at equal per-micro-batch costs."""
    _check_sizes(num_stages, micro_batches)
    return (num_stages - 1) / (micro_batches + num_stages - 1)


def theoretical_peak_in_flight(schedule: str, num_stages: int, micro_batches: int, rank: int) -> int:
    """Micro-batches whose activations rank ``rank`` holds at most: ``m`` (GPipe), ``min(p - rank, m)`` (1F1B)."""
    _check_schedule_name(schedule)
    _check_sizes(num_stages, micro_batches, rank)
    return micro_batches if schedule == "gpipe" else min(num_stages - rank, micro_batches)


def bubble_fraction(timeline: Sequence[Event], makespan: float | None = None) -> float:
    """``1 - busy / makespan`` of one rank: ``busy`` the time in its ``F`` and ``B`` actions,
    ``makespan`` the whole pipeline's duration (default: the end of this rank's last action)."""
    if makespan is None:
        makespan = max(e.end for e in timeline)
    busy = sum(e.end - e.start for e in timeline if e.op in COMPUTE_OPS)
    return 1.0 - busy / makespan


def measured_bubble(timelines: Sequence[Sequence[Event]]) -> list[float]:
    """Every rank's :func:`bubble_fraction`, against the makespan of the slowest rank."""
    makespan = max(e.end for timeline in timelines for e in timeline)
    return [bubble_fraction(timeline, makespan) for timeline in timelines]


# ----------------------------------------------------------------------------------------------
# Stages
# ----------------------------------------------------------------------------------------------


def split_blocks(num_blocks: int, num_stages: int) -> list[range]:
    """Consecutive blocks per stage, as even as possible (the first stages take one more when
    ``num_stages`` does not divide ``num_blocks``): ``split_blocks(5, 2) == [range(0, 3), range(3, 5)]``."""
    require_positive("num_blocks", num_blocks, integer=True)
    require_positive("num_stages", num_stages, integer=True)
    if num_stages > num_blocks:
        raise ValueError(f"num_stages={num_stages} is more than num_blocks={num_blocks}: every stage needs a block")
    size, extra = divmod(num_blocks, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + size + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def sequential_stages(blocks: nn.Sequential, num_stages: int) -> list[nn.Sequential]:
    """An ``nn.Sequential`` cut into ``num_stages`` consecutive slices (sharing its modules)."""
    if not isinstance(blocks, nn.Sequential):
        raise TypeError(f"blocks must be an nn.Sequential, got {type(blocks).__name__}")
    return [blocks[part.start:part.stop] for part in split_blocks(len(blocks), num_stages)]


class LlamaStage(nn.Module):
    """Decoder layers ``layers`` of a ``llmu.models.LlamaModel``, with the embedding when ``first``
    and the final norm and LM head when ``last``: token ids (or hidden states) in, hidden states
    (or logits) out. The modules are the model's own (shared, not copied)."""

    def __init__(self, model, layers: range, first: bool, last: bool):
        super().__init__()
        self.layer_ids = layers
        self.first, self.last = first, last
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self._rope_tables = model.rope_tables            # the model's cached cos/sin tables
        self._backend = model.attention_backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed_tokens(x)
        cos, sin = self._rope_tables(0, x.shape[1])
        for layer in self.layers:
            x, _ = layer(x, cos, sin, backend=self._backend)
        if self.last:
            x = self.lm_head(self.norm(x))
        return x

    def extra_repr(self) -> str:
        return f"layers={self.layer_ids.start}..{self.layer_ids.stop - 1}, first={self.first}, last={self.last}"


def llama_stages(model, num_stages: int) -> list[LlamaStage]:
    """A ``LlamaModel`` cut into ``num_stages`` :class:`LlamaStage` (its layers split by :func:`split_blocks`)."""
    from llmu.models.llama import LlamaModel

    if not isinstance(model, LlamaModel):
        raise TypeError(f"model must be a llmu.models LlamaModel, got {type(model).__name__}")
    if model.config.tie_word_embeddings and num_stages > 1:
        raise ValueError("the model ties its embedding and LM head, which would live on the first and the last "
                         "stage: build it with tie_word_embeddings=False")
    parts = split_blocks(model.config.num_hidden_layers, num_stages)
    return [LlamaStage(model, part, s == 0, s == num_stages - 1) for s, part in enumerate(parts)]


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``(B, T, V)`` logits against ``(B, T)`` target ids."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ----------------------------------------------------------------------------------------------
# The runner
# ----------------------------------------------------------------------------------------------


@dataclass
class PipelineResult:
    """What :func:`pipeline_step` returns on one rank.

    ``loss``: the whole batch's mean loss (computed on the last stage, broadcast to every rank);
    ``timeline``: this rank's actions as :class:`Event` (seconds after the common start);
    ``makespan``: seconds until the slowest rank finished; ``bubble``: this rank's idle fraction
    (:func:`bubble_fraction` against ``makespan``); ``peak_in_flight``: the most micro-batches whose
    activations this rank held at once.
    """

    rank: int
    world_size: int
    schedule: str
    micro_batches: int
    loss: float
    timeline: list[Event]
    makespan: float
    bubble: float
    peak_in_flight: int


def _require_group(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("pipeline parallelism needs a process group: run it inside llmu.distributed.launch "
                           "(or after torch.distributed.init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


def _pad(start: float, seconds: float) -> None:
    """Sleep until ``seconds`` have passed since ``start`` (the calibrated cost of an action)."""
    left = start + seconds - time.perf_counter()
    if left > 0:
        time.sleep(left)


def pipeline_step(stages: Sequence[nn.Module], inputs: torch.Tensor | None, targets: torch.Tensor | None,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, micro_batches: int,
                  activation_shape: Sequence[int], schedule: str = "1f1b",
                  activation_dtype: torch.dtype = torch.float32, forward_s: float = 0.0,
                  backward_s: float | None = None, group=None) -> PipelineResult:
    """One pipelined forward and backward of a batch; call it on every rank of ``group`` at once.

    ``stages``: the ``p`` stages, ``p`` the group's size; this rank runs ``stages[rank]`` and
    touches no other entry (a real system builds only its own stage; here every rank may build the
    whole model from one seed, which keeps the single-process oracle at hand). ``inputs``: the
    batch, ``(B, ...)``, read on the first stage; ``targets``: read on the last, where
    ``loss_fn(output, targets)`` gives each micro-batch's *mean* loss. Both are cut into
    ``micro_batches`` equal micro-batches along dim 0 (``B`` must be divisible by it).
    ``activation_shape``: the shape of one micro-batch's activation between two stages (the
    receivers allocate it), e.g. ``(B / m, T, d)``; ``activation_dtype`` its dtype.

    The gradients of ``stages[rank]``'s parameters are *accumulated* into their ``.grad`` (zero
    them before, step the optimizer after, as in single-process training): they equal the
    gradients of the mean loss over the whole batch. ``forward_s`` / ``backward_s`` (default
    ``2 * forward_s``): the calibrated cost of each ``F`` / ``B`` (see the module docstring).
    """
    world, rank = _require_group(group)
    _check_schedule_name(schedule)
    require_positive("micro_batches", micro_batches, integer=True)
    count = len(stages) if hasattr(stages, "__len__") and hasattr(stages, "__getitem__") else None
    if count != world:
        got = f"{count} stages" if count is not None else type(stages).__name__
        raise ValueError(f"stages must hold one stage per rank (a list): {world} ranks, got {got}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (output, targets) -> mean loss, got {type(loss_fn).__name__}")
    backward_s = 2.0 * forward_s if backward_s is None else backward_s
    for name, value in (("forward_s", forward_s), ("backward_s", backward_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    activation_shape = tuple(activation_shape)
    first, last = rank == 0, rank == world - 1
    m = micro_batches

    def split(name, batch):
        if not isinstance(batch, torch.Tensor):
            raise TypeError(f"{name} must be a tensor on rank {rank}, got {type(batch).__name__}")
        if batch.ndim == 0 or batch.shape[0] % m:
            raise ValueError(f"{name} has batch size {tuple(batch.shape)[:1]}, not divisible into "
                             f"micro_batches={m} equal micro-batches")
        return batch.chunk(m)

    input_chunks = split("inputs", inputs) if first else None
    target_chunks = split("targets", targets) if last else None
    # the neighbours' ranks in the default group (what send/recv address)
    global_rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    prev_rank = None if first else global_rank(rank - 1)
    next_rank = None if last else global_rank(rank + 1)
    stage = stages[rank]

    received: dict[int, torch.Tensor] = {}      # activations (or output gradients) that arrived
    stash: dict[int, tuple] = {}                # in flight: (input, output) kept for the backward
    input_grads: dict[int, torch.Tensor] = {}   # gradients to send up
    pending = []                                # (work, tensor) of the sends not yet completed
    loss_sum = torch.zeros((), dtype=torch.float64)
    peak, timeline = 0, []

    dist.barrier(group)
    t0 = time.perf_counter()
    for op, i in stage_actions(schedule, world, m, rank):
        start = time.perf_counter()
        if op == "recv_act":
            buf = torch.empty(activation_shape, dtype=activation_dtype)
            dist.recv(buf, prev_rank, group=group, tag=i)
            received[i] = buf.requires_grad_()   # a leaf: its .grad is what travels back
        elif op == "F":
            x = input_chunks[i] if first else received.pop(i)
            out = stage(x)
            if last:
                out = loss_fn(out, target_chunks[i]) / m   # mean over the micro-batch, / m: the batch mean
                loss_sum += out.detach().double()
            elif tuple(out.shape) != activation_shape or out.dtype != activation_dtype:
                raise ValueError(f"stage {rank} returned {tuple(out.shape)} {out.dtype}, but activation_shape="
                                 f"{activation_shape} {activation_dtype} is what the next stage receives")
            if not out.requires_grad:
                raise ValueError(f"stage {rank}'s output does not require grad: its parameters must "
                                 f"(call .train().requires_grad_(True) on the model)")
            stash[i] = (x, out)
            peak = max(peak, len(stash))
            _pad(start, forward_s)
        elif op == "send_act":
            activation = stash[i][1].detach()
            pending.append((dist.isend(activation, next_rank, group=group, tag=i), activation))
        elif op == "recv_grad":
            buf = torch.empty(activation_shape, dtype=activation_dtype)
            dist.recv(buf, next_rank, group=group, tag=i)
            received[i] = buf
        elif op == "B":
            x, out = stash.pop(i)
            torch.autograd.backward(out, None if last else received.pop(i))
            if not first:
                input_grads[i] = x.grad
            _pad(start, backward_s)
        else:  # "send_grad"
            grad = input_grads.pop(i)
            pending.append((dist.isend(grad, prev_rank, group=group, tag=i), grad))
        timeline.append(Event(op, i, start - t0, time.perf_counter() - t0))
    for work, _ in pending:
        work.wait()

    # the pipeline's duration (the slowest rank's), and the batch loss from the last stage
    makespan = torch.tensor([timeline[-1].end], dtype=torch.float64)
    dist.all_reduce(makespan, op=dist.ReduceOp.MAX, group=group)
    dist.broadcast(loss_sum, global_rank(world - 1), group=group)
    makespan = makespan.item()
    return PipelineResult(rank=rank, world_size=world, schedule=schedule, micro_batches=m, loss=loss_sum.item(),
                          timeline=timeline, makespan=makespan, bubble=bubble_fraction(timeline, makespan),
                          peak_in_flight=peak)


# ----------------------------------------------------------------------------------------------
# The picture
# ----------------------------------------------------------------------------------------------


def timeline_figure(timelines: Sequence[Sequence[Event]], title: str | None = None, messages: bool = True):
    """One row per rank (rank 0 on top), one bar per action: ``F`` and ``B`` coloured and labelled
    with their micro-batch, the receives (waiting for a peer) in grey when ``messages``. Times in ms.

    ``timelines``: per rank, a list of :class:`Event` (or ``(op, micro_batch, start, end)``
    tuples), as ``pipeline_step`` or :func:`ideal_timeline` give them. The default title gives the
    mean measured bubble."""
    import plotly.graph_objects as go

    from llmu.viz import COLORS, style

    timelines = [[Event(*e) for e in timeline] for timeline in timelines]
    if not timelines or not all(timelines):
        raise ValueError("timelines must hold one non-empty list of events per rank")
    rows = [f"rank {r}" for r in range(len(timelines))]
    kinds = [("F", "forward", COLORS[0]), ("B", "backward", COLORS[1])]
    if messages:
        kinds += [(("recv_act", "recv_grad"), "receive (waiting)", "#BBBBBB")]
    fig = go.Figure()
    for ops, name, color in kinds:
        events = [(r, e) for r, timeline in enumerate(timelines) for e in timeline if e.op in ops]
        if not events:
            continue
        compute = name != "receive (waiting)"
        fig.add_trace(go.Bar(
            y=[rows[r] for r, _ in events], x=[(e.end - e.start) * 1e3 for _, e in events],
            base=[e.start * 1e3 for _, e in events], orientation="h", name=name, marker_color=color,
            marker_line=dict(color="white", width=1), width=0.8 if compute else 0.35,
            text=[str(e.micro_batch) for _, e in events] if compute else None,
            textposition="inside", insidetextanchor="middle",
            customdata=[[e.op, e.micro_batch, e.start * 1e3, e.end * 1e3] for _, e in events],
            hovertemplate="%{y}: %{customdata[0]} micro-batch %{customdata[1]}<br>"
                          "%{customdata[2]:.1f} to %{customdata[3]:.1f} ms<extra></extra>"))
    if title is None:
        bubbles = measured_bubble(timelines)
        title = f"{len(timelines)} stages: bubble {sum(bubbles) / len(bubbles):.1%} (mean over the ranks)"
    fig.update_layout(barmode="overlay", bargap=0.2)
    fig.update_yaxes(categoryorder="array", categoryarray=rows, autorange="reversed")
    return style(fig, title, "time (ms)", None, height=max(220, 90 + 60 * len(rows)))


# ----------------------------------------------------------------------------------------------
# For the notebook
# ----------------------------------------------------------------------------------------------


def demo(rank: int, world_size: int, schedule: str = "1f1b", micro_batches: int = 8, forward_s: float = 0.02,
         backward_s: float | None = None, micro_batch_size: int = 2, seq_len: int = 16,
         layers_per_stage: int = 1, seed: int = 0) -> dict:
    """One pipelined training step of a tiny Llama, checked against single-process training.

    Run it with ``llmu.distributed.launch(demo, 4, "1f1b", 8)``. Every rank builds the same
    ``tiny_llama`` (``layers_per_stage * world_size`` layers) and batch from ``seed``, runs
    :func:`pipeline_step` on its stage (twice: the first is a warm-up), and the single-process step
    on a second copy. Returns a
    dict: ``timeline`` (this rank's :class:`Event` list), ``bubble`` (measured) and
    ``bubble_theory`` (the formula), ``ideal_bubble`` (this rank's, from :func:`ideal_timeline`
    with the same costs), ``peak_in_flight`` and ``peak_in_flight_theory``, ``makespan_s``,
    ``loss`` and ``loss_error``, and ``grad_error``: the largest difference between this stage's
    gradients and the single-process ones, relative to the largest gradient.
    """
    from llmu.models import tiny_llama

    require_positive("micro_batch_size", micro_batch_size, integer=True)
    require_positive("layers_per_stage", layers_per_stage, integer=True)
    layers = layers_per_stage * world_size
    model = tiny_llama(seed, num_hidden_layers=layers).train().requires_grad_(True)
    reference = tiny_llama(seed, num_hidden_layers=layers).train().requires_grad_(True)
    batch = micro_batches * micro_batch_size
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(model.config.vocab_size, (batch, seq_len + 1), generator=g)
    inputs, targets = ids[:, :-1], ids[:, 1:]

    # single process: the whole batch at once
    ref_loss = causal_lm_loss(reference(inputs).logits, targets)
    ref_loss.backward()

    # the pipeline: this rank's stage only. The first step pays one-time costs (PyTorch sets up
    # some CPU kernels on first use: the embedding's first backward alone takes about 0.4 s),
    # which would show as a bubble; it is a warm-up, and the second step is the one measured.
    stages = llama_stages(model, world_size)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        result = pipeline_step(stages, inputs, targets, causal_lm_loss, schedule=schedule,
                               micro_batches=micro_batches,
                               activation_shape=(micro_batch_size, seq_len, model.config.hidden_size),
                               forward_s=forward_s, backward_s=backward_s)
    mine = {id(p) for p in stages[rank].parameters()}
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if id(p) in mine]
    scale = max(max(ref.abs().max().item() for _, ref in pairs), 1e-30)
    grad_error = max((got - ref).abs().max().item() for got, ref in pairs) / scale

    orders = [compute_order(schedule, world_size, micro_batches, r) for r in range(world_size)]
    backward = 2.0 * forward_s if backward_s is None else backward_s
    ideal = measured_bubble(ideal_timeline(orders, forward_s or 1.0, backward or 2.0))[rank]
    return {
        "rank": rank, "schedule": schedule, "micro_batches": micro_batches, "timeline": result.timeline,
        "bubble": result.bubble, "bubble_theory": theoretical_bubble(world_size, micro_batches),
        "ideal_bubble": ideal, "peak_in_flight": result.peak_in_flight,
        "peak_in_flight_theory": theoretical_peak_in_flight(schedule, world_size, micro_batches, rank),
        "makespan_s": result.makespan, "loss": result.loss, "loss_error": abs(result.loss - ref_loss.item()),
        "grad_error": grad_error,
    }
