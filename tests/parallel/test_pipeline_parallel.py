"""Pipeline parallelism (llmu.parallel.pipeline_parallel) on real gloo processes.

The oracle is single-process training: every rank builds the same ``tiny_llama`` (one decoder
layer per rank; the embedding on rank 0, the norm, LM head and loss on the last rank) and the
same batch from one seed, runs one GPipe or 1F1B step on its stage, and compares the gradients of
its stage, the batch loss and the parameters after an SGD step with those of the whole model
trained on the whole batch in one process. One ``nn.Sequential`` MLP case checks the generic
stage path as well.

Tolerances, float32: ``1e-5`` relative to the largest reference value. The pipeline computes the
same products as the single process, but sums the batch in another grouping (per micro-batch,
then over the ``m`` micro-batches, with the ``1/m`` scaling in between): a few roundings of
``6e-8`` each; the largest error seen is about ``5e-7``. A wrong schedule or a missing ``1/m``
gives errors of order one.

The bubble, from the order of events, not from the clock. Every rank returns its timeline: the
``(op, micro_batch)`` actions in the order they ran, with their start and end times. The test
checks, on every rank:

* the order is the schedule's (``stage_actions``), the actions do not overlap and no time runs
  backwards (one process, one monotonic clock);
* the ``F``/``B`` order, replayed through ``ideal_timeline`` with equal costs on every stage,
  leaves exactly ``theoretical_bubble(p, m)``: the schedule that ran has the bubble of the formula;
* the makespan the rank reported is the latest end over all the gathered timelines, and its
  bubble is ``1 - busy / makespan`` recomputed from them (arithmetic on the recorded times, not a
  measurement);
* the peak number of micro-batches in flight is the theory's.

How large the *measured* bubble is depends on the load of the machine (every action and message
carries fixed costs: Python, gloo, a process waking up), so no test asserts on it. The benchmark
``pipeline_bubble`` (``llmu bench pipeline_bubble --sizes cpu``, in ``llmu.parallel.bench``)
measures it against the formula, with the load average beside each row.

Across ranks only the order of events is compared, never their times: each rank's times count
from the moment it left the starting barrier, and the ranks leave it at different moments (by
milliseconds or more on a loaded machine). What the ranks' orders say together is checked
(``check_schedule``: every ``F`` and ``B`` once, ``F i`` before ``B i``, no deadlock); that each
message arrived after it was sent follows from the gradients being right.

The calibrated pads (``forward_s``). One more step, 1F1B at ``p = 4``, ``m = 8``, runs with a small
pad, 2 ms per ``F`` and 4 ms per ``B``, with the same checks as the others plus one: every padded
action lasted at least its pad, a lower bound that ``time.sleep`` guarantees whatever the load (an
upper bound would not hold). It is kept because nothing else checks that sleeping changes no
number and that every ``F`` and ``B`` gets its pad (the benchmark's test runs the pads
through ``demo`` but checks only the arithmetic of its rows), and it costs about 0.1 s inside the
launch that runs anyway. There is no band and no retry: nothing in it can fail because the
machine is busy.

Spawning a process group costs seconds, so ONE ``launch`` of 4 ranks runs everything: every case
at ``p = 4`` on all of them, then every case at ``p = 2`` on two groups of two ranks at once (which
runs the runner's ``group=`` path as well: ranks within a group are not the global ranks that
``send`` and ``recv`` address).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import llmu  # noqa: F401  (sets the Triton mode before anything imports triton)
from llmu.distributed import launch
from llmu.models import tiny_llama
from llmu.parallel import pipeline_parallel as PP
from llmu.parallel.pipeline_parallel import Action, Event

RTOL = 1e-5
BATCH, SEQ, SEED, LR = 8, 12, 3, 0.1
MICRO_BATCHES = (1, 4, 8)
PAD_S = 0.002                     # the pad of an F in the padded step; a B gets twice that
PADDED = ("1f1b", 8)              # (schedule, m) of the padded step
PAIRS = ([0, 1], [2, 3])          # the two p = 2 pipelines inside the launch of 4
CLOCK_ROUNDING_S = 1e-9           # times are differences of two clock readings: allow their rounding


# ---------------------------------------------------------------------------------------------
# the cases, run on every rank of one launch
# ---------------------------------------------------------------------------------------------


def _rel(a, b):
    return ((a - b).abs().max() / max(b.abs().max().item(), 1.0)).item()


def _llama(world):
    return tiny_llama(SEED, num_hidden_layers=world).train().requires_grad_(True)


def _batch():
    ids = torch.randint(97, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(SEED))
    return ids[:, :-1], ids[:, 1:]


@torch.no_grad()
def _sgd_step(params):
    """Plain SGD, ``p -= lr * grad``, written out: the first ``torch.optim`` optimizer of a
    process costs about 2 s of imports, paid by every rank."""
    for p in params:
        p -= LR * p.grad


def _reference(world):
    """The whole model on the whole batch, in this process: loss, gradients, parameters after SGD."""
    model = _llama(world)
    inputs, targets = _batch()
    loss = PP.causal_lm_loss(model(inputs).logits, targets)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    _sgd_step(model.parameters())
    return loss.item(), grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def _structure(events, schedule, world, m, rank, forward_s):
    """What is wrong with one rank's timeline, as readable lines (empty when nothing is).

    Only what holds whatever the load: the order of the actions, times that never run backwards
    within the rank (one monotonic clock), and each padded action lasting at least its pad."""
    problems = []
    if [(e.op, e.micro_batch) for e in events] != [tuple(a) for a in PP.stage_actions(schedule, world, m, rank)]:
        problems.append("the actions ran are not the schedule's")
    if any(e.end < e.start for e in events) or any(b.start < a.end for a, b in zip(events, events[1:])):
        problems.append("actions overlap or run backwards in time")
    for e in events:
        pad = {"F": forward_s, "B": 2 * forward_s}.get(e.op, 0.0)
        if e.end - e.start < pad - CLOCK_ROUNDING_S:
            problems.append(f"{e.op}{e.micro_batch} lasted {e.end - e.start:.6f} s, less than its pad {pad} s")
    return problems


def _pipeline_case(rank, world, schedule, m, reference, forward_s=0.0, group=None):
    """One training step through the pipeline on this rank's stage, and what the test checks on it.
    ``rank`` and ``world``: this rank's place in ``group`` (the default group when None)."""
    ref_loss, ref_grads, ref_params = reference
    model = _llama(world)
    stages = PP.llama_stages(model, world)
    inputs, targets = _batch()
    result = PP.pipeline_step(stages, inputs, targets, PP.causal_lm_loss, schedule=schedule, micro_batches=m,
                              activation_shape=(BATCH // m, SEQ, model.config.hidden_size), forward_s=forward_s,
                              group=group)

    names = [name for name, p in model.named_parameters() if any(p is q for q in stages[rank].parameters())]
    params = dict(model.named_parameters())
    out = {
        "grad": max(_rel(params[n].grad, ref_grads[n]) for n in names),
        "other_stages_untouched": all(p.grad is None for n, p in params.items() if n not in names),
        "loss": abs(result.loss - ref_loss) / abs(ref_loss),
        "peak_in_flight": result.peak_in_flight,
        "place": (result.rank, result.world_size),
        "structure": _structure(result.timeline, schedule, world, m, rank, forward_s),
        "timeline": result.timeline, "bubble": result.bubble, "makespan": result.makespan,
    }
    _sgd_step([params[n] for n in names])
    out["param"] = max(_rel(params[n].detach(), ref_params[n]) for n in names)
    return out


def _mlp_case(rank, world, m=4, hidden=16):
    """The generic path: an nn.Sequential of MLP blocks cut into stages, a mean-squared-error loss."""
    torch.manual_seed(SEED)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(2 * world)])
    reference = [p.detach().clone() for p in blocks.parameters()]
    g = torch.Generator().manual_seed(SEED + 1)
    x, y = torch.randn(BATCH, hidden, generator=g), torch.randn(BATCH, hidden, generator=g)
    stages = PP.sequential_stages(blocks, world)
    PP.pipeline_step(stages, x, y, F.mse_loss, schedule="1f1b", micro_batches=m, activation_shape=(BATCH // m, hidden))
    mine = list(stages[rank].parameters())

    whole = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(2 * world)])
    with torch.no_grad():
        for p, value in zip(whole.parameters(), reference):
            p.copy_(value)
    F.mse_loss(whole(x), y).backward()
    ref_grads = {id(p): q.grad for p, q in zip(blocks.parameters(), whole.parameters())}
    return max(_rel(p.grad, ref_grads[id(p)]) for p in mine)


def _cases(rank, world, group=None):
    """Every schedule and micro-batch count at ``world`` stages, on ``group``."""
    reference = _reference(world)
    return {(schedule, m, 0.0): _pipeline_case(rank, world, schedule, m, reference, group=group)
            for schedule in PP.SCHEDULES for m in MICRO_BATCHES}


def _run_all(rank, world):
    """``p = 4`` on the default group (and the padded step, and the MLP), then ``p = 2`` on two
    groups of two ranks at once: one launch for both world sizes, and the runner's ``group=``
    path (ranks in the group are not the global ranks that ``send`` and ``recv`` address) with it."""
    pairs = [dist.new_group(ranks) for ranks in PAIRS]          # every rank takes part in creating each
    four = _cases(rank, world)
    four[(*PADDED, PAD_S)] = _pipeline_case(rank, world, *PADDED, _reference(world), forward_s=PAD_S)
    pair = pairs[rank // 2]
    two = _cases(dist.get_rank(pair), 2, group=pair)
    return {"rank": rank, "world": dist.get_world_size(), "pipelines": {4: four, 2: two},
            "mlp_grad": _mlp_case(rank, world)}


def _bubble_problems(where, timelines, reported, makespans, world, m):
    """The bubble checks of one case, from the gathered timelines of all ranks (see the module
    docstring): order replayed at equal costs, and the reported figures recomputed."""
    problems = []
    orders = [[Action(e.op, e.micro_batch) for e in timeline if e.op in PP.COMPUTE_OPS] for timeline in timelines]
    try:
        PP.check_schedule(orders, m)           # every F and B once, F i before B i, no deadlock
    except ValueError as exc:
        return [f"{where}: the orders that ran are no valid schedule: {exc}"]
    theory = PP.theoretical_bubble(world, m)
    replayed = PP.measured_bubble(PP.ideal_timeline(orders))
    if any(abs(b - theory) > 1e-12 for b in replayed):
        problems.append(f"{where}: the order that ran, at equal costs, leaves bubbles {replayed}, theory {theory}")
    # arithmetic on the recorded times: the makespan is the latest end, each bubble 1 - busy / makespan
    latest = max(e.end for timeline in timelines for e in timeline)
    if any(abs(s - latest) > 1e-12 for s in makespans):
        problems.append(f"{where}: reported makespans {makespans} != the latest end {latest}")
    recomputed = PP.measured_bubble(timelines)
    if max(abs(a - b) for a, b in zip(recomputed, reported)) > 1e-9:
        problems.append(f"{where}: bubbles from the timelines {recomputed} != reported {reported}")
    return problems


def test_pipeline_equals_single_process():
    """Every schedule and micro-batch count at p = 4 and at p = 2 (twice), and the padded step."""
    results = launch(_run_all, 4)
    assert [(r["rank"], r["world"]) for r in results] == [(rank, 4) for rank in range(4)]
    problems = []
    for world, members in [(4, PAIRS[0] + PAIRS[1])] + [(2, pair) for pair in PAIRS]:
        ranks = [results[g] for g in members]
        for schedule, m, forward_s in ranks[0]["pipelines"][world]:
            case = [r["pipelines"][world][schedule, m, forward_s] for r in ranks]
            label = f"{schedule}, p={world} on ranks {members}, m={m}" + \
                (f", padded {forward_s * 1e3:g} ms" if forward_s else "")
            for rank, got in enumerate(case):
                where = f"{label}, rank {rank}"
                if got["place"] != (rank, world):
                    problems.append(f"{where}: the runner says it is rank {got['place'][0]} of {got['place'][1]}")
                for key in ("grad", "param", "loss"):
                    if not got[key] <= RTOL:
                        problems.append(f"{where}: relative {key} error {got[key]:.2e} above {RTOL}")
                if not got["other_stages_untouched"]:
                    problems.append(f"{where}: the rank wrote gradients into another rank's stage")
                expected_peak = PP.theoretical_peak_in_flight(schedule, world, m, rank)
                if got["peak_in_flight"] != expected_peak:
                    problems.append(f"{where}: {got['peak_in_flight']} micro-batches in flight, theory {expected_peak}")
                problems += [f"{where}: {line}" for line in got["structure"]]
            problems += _bubble_problems(label, [c["timeline"] for c in case], [c["bubble"] for c in case],
                                         [c["makespan"] for c in case], world, m)
    for rank, r in enumerate(results):
        if not r["mlp_grad"] <= RTOL:
            problems.append(f"nn.Sequential stages, rank {rank}: relative gradient error {r['mlp_grad']:.2e}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# schedules, no processes needed
# ---------------------------------------------------------------------------------------------


def test_schedules_by_hand():
    assert PP.format_schedule("1f1b", 2, 3) == "rank 0: F0 F1 B0 F2 B1 B2\nrank 1: F0 B0 F1 B1 F2 B2"
    assert PP.format_schedule("gpipe", 2, 3) == "rank 0: F0 F1 F2 B0 B1 B2\nrank 1: F0 F1 F2 B0 B1 B2"
    assert PP.format_schedule("1f1b", 4, 5).splitlines() == [
        "rank 0: F0 F1 F2 F3 B0 F4 B1 B2 B3 B4",   # 3 warm-up forwards, 2 steady pairs, 3 cool-down backwards
        "rank 1: F0 F1 F2 B0 F3 B1 F4 B2 B3 B4",
        "rank 2: F0 F1 B0 F2 B1 F3 B2 F4 B3 B4",
        "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4",   # the last stage: one forward, one backward
    ]
    # fewer micro-batches than stages: rank 0's 1F1B has no steady state and is GPipe's order
    assert PP.compute_order("1f1b", 4, 2, 0) == PP.compute_order("gpipe", 4, 2, 0)
    assert PP.format_schedule("gpipe", 3, 2, messages=True).splitlines() == [
        "rank 0: F0 send_act(0) F1 send_act(1) recv_grad(0) B0 recv_grad(1) B1",
        "rank 1: recv_act(0) F0 send_act(0) recv_act(1) F1 send_act(1) recv_grad(0) B0 send_grad(0) "
        "recv_grad(1) B1 send_grad(1)",
        "rank 2: recv_act(0) F0 recv_act(1) F1 B0 send_grad(0) B1 send_grad(1)",
    ]


def test_ideal_timeline_by_hand():
    """GPipe, p = 2, m = 2, t_f = 1, t_b = 2: the makespan is (m + p - 1)(t_f + t_b) = 9."""
    orders = [PP.compute_order("gpipe", 2, 2, r) for r in range(2)]
    assert PP.ideal_timeline(orders) == [
        [Event("F", 0, 0, 1), Event("F", 1, 1, 2), Event("B", 0, 5, 7), Event("B", 1, 7, 9)],
        [Event("F", 0, 1, 2), Event("F", 1, 2, 3), Event("B", 0, 3, 5), Event("B", 1, 5, 7)],
    ]
    assert PP.measured_bubble(PP.ideal_timeline(orders)) == [pytest.approx(1 / 3)] * 2


def _in_flight_peak(order):
    live = peak = 0
    for op, _ in order:
        live += 1 if op == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("schedule", PP.SCHEDULES)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_schedules_are_valid_and_leave_the_theoretical_bubble(schedule, p, m):
    orders = [PP.compute_order(schedule, p, m, r) for r in range(p)]
    PP.check_schedule(orders, m)              # every F and B once, F before B, no deadlock
    assert [_in_flight_peak(order) for order in orders] == \
        [PP.theoretical_peak_in_flight(schedule, p, m, r) for r in range(p)]
    for costs in ((1.0, 2.0), (1.0, 1.0), (0.3, 0.7)):
        bubbles = PP.measured_bubble(PP.ideal_timeline(orders, *costs))
        assert bubbles == [pytest.approx(PP.theoretical_bubble(p, m), abs=1e-12)] * p


def test_check_schedule_rejects_bad_orders():
    gpipe = [PP.compute_order("gpipe", 2, 2, r) for r in range(2)]
    with pytest.raises(ValueError, match="rank 1 must run B once for each micro-batch 0..1"):
        PP.check_schedule([gpipe[0], gpipe[1][:-1]], 2)
    with pytest.raises(ValueError, match="rank 0 runs B0 before F0"):
        PP.check_schedule([[Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1)], gpipe[1]], 2)
    # rank 0 waits for B0's gradient before it sends F1, rank 1 waits for F1 before it runs B0
    deadlock = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)], gpipe[1]]
    with pytest.raises(ValueError, match="deadlocks"):
        PP.check_schedule(deadlock, 2)


def test_bad_sizes_and_names():
    with pytest.raises(ValueError, match="micro_batches must be positive"):
        PP.compute_order("1f1b", 2, 0, 0)
    with pytest.raises(TypeError, match="micro_batches"):
        PP.compute_order("1f1b", 2, True, 0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        PP.compute_order("pipedream", 2, 4, 0)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, num_stages=2\)"):
        PP.compute_order("gpipe", 2, 4, 2)
    with pytest.raises(ValueError, match="micro_batches must be positive"):
        PP.theoretical_bubble(4, 0)
    with pytest.raises(ValueError, match="num_stages=5 is more than num_blocks=4"):
        PP.llama_stages(tiny_llama(0, num_hidden_layers=4), 5)
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        PP.llama_stages(tiny_llama(0, tie_word_embeddings=True), 2)
    assert PP.split_blocks(5, 2) == [range(0, 3), range(3, 5)]
    with pytest.raises(RuntimeError, match="needs a process group"):
        PP.pipeline_step([nn.Linear(2, 2)], torch.randn(2, 2), torch.randn(2, 2), F.mse_loss,
                         micro_batches=1, activation_shape=(2, 2))


# ---------------------------------------------------------------------------------------------
# the runner's own checks, in a one-process group (no spawn): p = 1 is a pipeline too
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_runner_checks_its_arguments(one_process_group):
    stage = nn.Linear(4, 4)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    kw = dict(activation_shape=(2, 4))
    with pytest.raises(ValueError, match=r"one stage per rank \(a list\): 1 ranks, got 2 stages"):
        PP.pipeline_step([stage, stage], x, y, F.mse_loss, micro_batches=4, **kw)
    with pytest.raises(ValueError, match="micro_batches must be positive"):
        PP.pipeline_step([stage], x, y, F.mse_loss, micro_batches=0, **kw)
    with pytest.raises(ValueError, match="not divisible into micro_batches=3"):
        PP.pipeline_step([stage], x, y, F.mse_loss, micro_batches=3, **kw)
    with pytest.raises(ValueError, match="schedule must be one of"):
        PP.pipeline_step([stage], x, y, F.mse_loss, micro_batches=4, schedule="zb", **kw)
    with pytest.raises(ValueError, match="forward_s must be a number of seconds >= 0"):
        PP.pipeline_step([stage], x, y, F.mse_loss, micro_batches=4, forward_s=-1, **kw)
    with pytest.raises(ValueError, match="does not require grad"):
        PP.pipeline_step([stage.requires_grad_(False)], x, y, F.mse_loss, micro_batches=4, **kw)


def test_one_stage_pipeline_accumulates_the_batch_gradient(one_process_group):
    torch.manual_seed(0)
    stage, x, y = nn.Linear(4, 4), torch.randn(8, 4), torch.randn(8, 4)
    F.mse_loss(stage(x), y).backward()
    expected = stage.weight.grad.clone()
    stage.zero_grad()
    result = PP.pipeline_step([stage], x, y, F.mse_loss, micro_batches=4, activation_shape=(2, 4))
    assert _rel(stage.weight.grad, expected) <= RTOL
    assert result.peak_in_flight == 1 and result.bubble >= 0.0
    assert [e.op for e in result.timeline] == ["F", "B"] * 4


def test_timeline_figure():
    orders = [PP.compute_order("1f1b", 3, 4, r) for r in range(3)]
    timelines = PP.ideal_timeline(orders, 0.02, 0.04)
    fig = PP.timeline_figure(timelines)
    assert [t.name for t in fig.data] == ["forward", "backward"]          # no receives in an ideal timeline
    assert sum(len(t.x) for t in fig.data) == 3 * 2 * 4
    assert list(fig.data[0].text[:4]) == ["0", "1", "2", "3"]             # rank 0's forwards, labelled
    assert fig.data[0].base[1] == pytest.approx(20.0)                      # ms
    assert "bubble 33.3%" in fig.layout.title.text                        # (3 - 1) / (4 + 3 - 1)
    with pytest.raises(ValueError, match="one non-empty list"):
        PP.timeline_figure([])
