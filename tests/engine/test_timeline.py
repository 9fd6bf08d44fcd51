"""llmu.engine.timeline: the recorded history of an engine run, its model-free simulation, and the
pictures drawn from them.

The central property: with requests that ignore the end-of-sequence token, scheduling does not
depend on which tokens the model produces, so :func:`timeline.simulate` (the engine's Scheduler
and BlockManager, no model) must reproduce :func:`timeline.record` (a real engine) step for step,
under every scheduling configuration: continuous and static batching, chunked prefill, a pool
small enough to force preemption, prefix caching, contiguous reservations. The runs use a tiny
random model (2 layers, blocks of 4 positions, so a few tokens span several blocks); one test uses
SmolLM2 for what the notebook shows with chat prompts (the shared system prompt's block comes from
the prefix cache). Everything compared is bookkeeping (token counts, positions, block counts):
equality is exact, there is no tolerance.

Then the invariants of any run (hypothesis draws random workloads and configurations): no step
exceeds the token budget or ``max_num_seqs``, every request finishes exactly once after sampling
exactly ``max_tokens`` tokens, its prompt is computed once (plus recomputation after preemption,
minus what the prefix cache supplied), and the pool is whole again at the end. Last, the text
table and the figures show the steps they are given, and bad inputs raise errors that name the
argument.
"""

from __future__ import annotations

import plotly.graph_objects as go
import pytest
import torch
from hypothesis import given, settings, strategies as st

from llmu.engine import LLMEngine, SamplingParams, timeline
from llmu.models import LlamaModel, tiny_llama


def tiny_model(seed=0) -> LlamaModel:
    return tiny_llama(seed, scale=0.3, max_position_embeddings=256, eos_token_id=96)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def workload(n=8, seed=0, lo=1, hi=30, new_hi=10, shared=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 96, (shared,), generator=g).tolist()
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 96, (k,), generator=g).tolist() for k in lens]
    max_tokens = torch.randint(1, new_hi + 1, (n,), generator=g).tolist()
    return prompts, max_tokens


def params_for(max_tokens):
    return [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]


BASE = dict(num_blocks=200, block_size=4, max_model_len=128)
CONFIGS = {
    "continuous": dict(),
    "continuous, shared prefix": dict(max_num_seqs=3),
    "static": dict(policy="static", max_num_seqs=3),
    "tiny budget, chunked prefill": dict(max_num_batched_tokens=7),
    "no chunking": dict(chunked_prefill=False, max_num_batched_tokens=40),
    "few sequences": dict(max_num_seqs=2),
    "small pool: preemption": dict(num_blocks=14),
    "static, small pool": dict(policy="static", max_num_seqs=4, num_blocks=14),
    "reserve context": dict(reserve="context", max_model_len=48, num_blocks=40),
    "reserve max_tokens": dict(reserve="max_tokens", num_blocks=30),
    "no prefix caching": dict(prefix_caching=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_simulation_reproduces_a_real_run(tiny, name):
    kw = dict(BASE, **CONFIGS[name])
    prompts, max_tokens = workload(10, seed=1, new_hi=12, shared=8 if "shared" in name else 0)
    engine = LLMEngine(tiny, None, **kw)
    real = timeline.record(engine, prompts, params_for(max_tokens))
    sim = timeline.simulate(prompts, max_tokens, **kw)
    assert len(sim) == len(real), f"{name}: {len(sim)} simulated steps, {len(real)} real ones"
    for a, b in zip(real, sim):
        assert a.key() == b.key(), f"{name}: step {a.index} differs\nreal: {a}\nsim:  {b}"
    assert all(s.seconds is not None and s.seconds >= 0 for s in real) and all(s.seconds is None for s in sim)
    assert sum(s.running > 0 for s in real) == engine.stats.steps, "one recorded step with work per forward pass"
    preemptions = timeline.summary(real)["preemptions"]
    assert preemptions == engine.stats.preemptions
    if "small pool" in name:
        assert preemptions > 0, f"{name}: the pool of 14 blocks should force preemption"
        assert any(w.kind == "recompute" for s in real for w in s.work)
    if "shared" in name:
        assert timeline.summary(real)["cached_tokens"] > 0, "the shared 8-token prefix (2 blocks) should hit"


def check_invariants(steps, prompts, max_tokens, *, budget, max_num_seqs, num_blocks, prefix_caching):
    labels = [f"r{i}" for i in range(len(prompts))]
    sampled = dict.fromkeys(labels, 0)
    computed = dict.fromkeys(labels, 0)  # positions computed per request, prompt and output
    finished = []
    for s in steps:
        assert s.num_tokens <= budget, f"step {s.index}: {s.num_tokens} positions > budget {budget}"
        assert s.running <= max_num_seqs, f"step {s.index}: {s.running} sequences > max_num_seqs {max_num_seqs}"
        assert 0 <= s.free_blocks <= num_blocks and s.num_blocks == num_blocks
        assert len({w.label for w in s.work}) == s.running, "a sequence appears once per step"
        for w in s.work:
            assert w.tokens >= 1
            assert w.label not in finished, f"{w.label} runs after it finished"
            if w.kind == "decode":
                assert w.tokens == 1 and w.samples
            sampled[w.label] += w.samples
            computed[w.label] += w.tokens
        assert not set(s.finished) & set(s.waiting)
        finished += s.finished
    assert sorted(finished, key=lambda x: int(x[1:])) == labels, "every request finishes exactly once"
    assert sampled == dict(zip(labels, max_tokens)), "each request samples exactly max_tokens tokens"
    preempted = sum(len(s.preempted) for s in steps)
    cached = sum(s.cached_tokens for s in steps)
    for lab, p, m in zip(labels, prompts, max_tokens):
        # prompt + every output token but the last, each computed once ...
        assert computed[lab] >= len(p) + m - 1 - (cached if prefix_caching else 0)
        if not preempted and not prefix_caching:
            assert computed[lab] == len(p) + m - 1, f"{lab}: each position is computed exactly once"
    assert steps[-1].free_blocks == num_blocks, "every block is back in the pool at the end"
    assert steps[-1].waiting == []


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 8), seed=st.integers(0, 10_000), budget=st.sampled_from([3, 8, 20, 512]),
       seqs=st.integers(1, 5), blocks=st.integers(13, 60), policy=st.sampled_from(["continuous", "static"]),
       caching=st.booleans(), shared=st.sampled_from([0, 4, 9]))
def test_any_run_keeps_the_books(n, seed, budget, seqs, blocks, policy, caching, shared):
    prompts, max_tokens = workload(n, seed=seed, lo=1, hi=25, new_hi=12, shared=shared)
    kw = dict(num_blocks=blocks, block_size=4, max_num_seqs=seqs, max_num_batched_tokens=budget, policy=policy,
              prefix_caching=caching, max_model_len=128)
    steps = timeline.simulate(prompts, max_tokens, **kw)
    check_invariants(steps, prompts, max_tokens, budget=budget, max_num_seqs=seqs, num_blocks=blocks,
                     prefix_caching=caching)


def test_prompt_lengths_make_distinct_prompts():
    steps = timeline.simulate([8, 8, 8], 2, num_blocks=20, block_size=4)
    assert timeline.summary(steps)["cached_tokens"] == 0, "prompts given as lengths share no block"
    assert [w.tokens for w in steps[0].work] == [8, 8, 8]
    assert steps[0].work[0] == timeline.Work(0, 0, "prefill", 0, 8, True)
    assert steps[1].work[2] == timeline.Work(2, 0, "decode", 8, 1, True)
    assert steps[1].finished == ["r0", "r1", "r2"]


def test_static_batching_admits_only_into_an_empty_batch():
    prompts, max_tokens = [5] * 7, [9, 2, 4, 1, 6, 3, 2]
    steps = timeline.simulate(prompts, max_tokens, num_blocks=60, block_size=4, max_num_seqs=3, policy="static")
    alive: set = set()
    for s in steps:
        new = {w.label for w in s.work} - alive
        if new:
            assert not alive, f"step {s.index}: {sorted(new)} joined while {sorted(alive)} still ran"
        alive = ({w.label for w in s.work} | alive) - set(s.finished)
    cont = timeline.simulate(prompts, max_tokens, num_blocks=60, block_size=4, max_num_seqs=3)
    assert len(cont) < len(steps), "continuous batching needs fewer steps for the same work"
    assert timeline.summary(cont)["mean_running"] > timeline.summary(steps)["mean_running"]


def test_continuous_batching_refills_a_freed_slot_at_the_next_step():
    steps = timeline.simulate([4, 4, 4], [1, 5, 5], num_blocks=20, block_size=4, max_num_seqs=2)
    assert steps[0].finished == ["r0"] and steps[0].waiting == ["r2"]
    assert [w.label for w in steps[1].work] == ["r1", "r2"]
    assert steps[1].work[1].kind == "prefill" and steps[1].work[1].tokens == 4


def test_chunked_prefill_is_recorded_chunk_by_chunk():
    steps = timeline.simulate([3, 3, 20], [6, 6, 2], num_blocks=40, block_size=4, max_num_batched_tokens=8)
    chunks = [(w.start, w.tokens, w.samples) for s in steps for w in s.work if w.label == "r2"]
    assert chunks[:4] == [(0, 2, False), (2, 6, False), (8, 6, False), (14, 6, True)]
    assert chunks[4] == (20, 1, True) and len(chunks) == 5


def test_preemption_is_recorded_and_recomputed():
    steps = timeline.simulate([6, 6, 6], 12, num_blocks=9, block_size=4, prefix_caching=False)
    pre = [s for s in steps if s.preempted]
    assert pre, "three sequences growing to 18 positions do not fit 9 blocks of 4 (one kept spare)"
    victim = pre[0].preempted[0]
    assert victim == "r2", "the youngest running sequence gives way"
    assert victim in pre[0].waiting and pre[0].waiting[0] == victim, "back to the front of the queue"
    again = next(w for s in steps[pre[0].index + 1:] for w in s.work if w.label == victim)
    assert again.kind == "recompute" and again.start == 0 and again.tokens > 6, \
        "the prompt and the tokens generated so far are computed again"


def test_record_restores_the_scheduler_and_keeps_the_outputs(tiny):
    engine = LLMEngine(tiny, None, num_blocks=40, block_size=4, max_model_len=64)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))  # already queued: recorded too
    steps = timeline.record(engine, [[4, 5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert "schedule" not in vars(engine.scheduler), "the scheduler's own method is back"
    assert {w.label for s in steps for w in s.work} == {"r0", "r1"}
    assert [len(engine.output(r).outputs[0].token_ids) for r in (0, 1)] == [2, 3]
    with pytest.raises(RuntimeError, match="max_steps=2"):
        timeline.record(engine, [[1] * 5], SamplingParams(max_tokens=5, ignore_eos=True), max_steps=2)
    assert "schedule" not in vars(engine.scheduler), "restored after an error too"


@pytest.mark.slow
def test_record_on_smollm2_shows_the_shared_system_prompt(smollm2):
    model, tok = smollm2
    chats = [[{"role": "user", "content": q}] for q in ("Hi!", "What is 2 + 2?", "Name a colour.")]
    engine = LLMEngine(model, tok, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=64)
    steps = timeline.record(engine, chats, SamplingParams(max_tokens=2))
    first = {w.label: w for s in reversed(steps) for w in s.work}  # each request's first work
    assert first["r0"].start == 0 and first["r1"].start == 0, "admitted at step 0, before the block was computed"
    assert first["r2"].start == 16, "SmolLM2's system prompt fills one block of 16 that r2 finds in the cache"
    assert timeline.summary(steps)["cached_tokens"] == 16
    assert engine.output(2).cached_tokens == 16


def test_summary_counts():
    steps = timeline.simulate([5, 9], [3, 1], num_blocks=20, block_size=4)
    s = timeline.summary(steps)
    assert s == {"steps": 3, "forward_passes": 3, "prefill_tokens": 14, "decode_tokens": 2, "sampled_tokens": 4,
                 "mean_running": 4 / 3, "peak_running": 2, "preemptions": 0, "cached_tokens": 0, "seconds": None}


def test_table_has_a_line_per_step():
    steps = timeline.simulate([6, 6, 6], 12, num_blocks=9, block_size=4, prefix_caching=False)
    text = timeline.table(steps)
    lines = text.splitlines()
    assert len(lines) == len(steps) + 1 and lines[0].split()[:5] == ["step", "seqs", "prefill", "decode", "free"]
    assert "ms" not in lines[0], "no timing column for a simulation"
    assert "r0 prefill 6 (0-5)" in lines[1] and "r1 decode @6" in lines[2]
    assert "preempted r2" in text and "recompute" in text and "finished r0" in text
    assert all(len(line) < 60 * 2 + 40 for line in lines), "width cuts the long columns"
    assert "prompt positions from the prefix cache" in timeline.table(
        timeline.simulate([[1] * 8, [1] * 8 + [2]], 1, num_blocks=20, block_size=4, max_num_seqs=1))


def test_figure_shows_the_steps():
    steps = timeline.simulate([4, 12, 4, 8], [6, 2, 5, 3], num_blocks=30, block_size=4, max_num_seqs=2)
    fig = timeline.figure(steps, max_num_seqs=2, max_steps=30)
    assert isinstance(fig, go.Figure)
    bars = {t.name: t for t in fig.data if isinstance(t, go.Bar)}
    assert {"decode", "prefill", "idle slot", "waiting"} <= set(bars)
    assert "recompute" not in bars, "no preemption, no recompute series"
    assert list(bars["decode"].y) == [sum(w.kind == "decode" for w in s.work) for s in steps]
    assert list(bars["idle slot"].y) == [2 - s.running for s in steps]
    assert all("step" in h for h in bars["decode"].hovertext)
    heat = next(t for t in fig.data if isinstance(t, go.Heatmap))
    assert list(heat.y) == ["r0", "r1", "r2", "r3"]
    assert heat.z[0][0] == 1 and heat.z[2][0] == 0, "r0 prefills at step 0 while r2 waits"
    assert heat.z[0][-1] is None, "r0 is done by the last step"
    assert heat.text[0][0].startswith("r0 · step 0: prefill 4 (0-3)")
    assert tuple(fig.layout.xaxis2.range) == (-0.5, 29.5), "max_steps fixes the step axis"
    assert fig.layout.barmode == "stack"
    assert "steps" in fig.layout.title.text and "of 2 slots" in fig.layout.title.text
    no_slots = timeline.figure(steps)
    assert "idle slot" not in {t.name for t in no_slots.data}


def test_compare_stacks_the_runs():
    kw = dict(num_blocks=60, block_size=4, max_num_seqs=3)
    runs = {p: timeline.simulate([5] * 6, [8, 1, 3, 7, 2, 2], policy=p, **kw) for p in ("static", "continuous")}
    fig = timeline.compare(runs, max_num_seqs=3)
    titles = [a.text for a in fig.layout.annotations]
    assert titles[0].startswith(f"static: {len(runs['static'])} steps")
    assert titles[1].startswith(f"continuous: {len(runs['continuous'])} steps")
    legend = [t.name for t in fig.data if t.showlegend]
    assert sorted(legend) == ["decode", "idle slot", "prefill"], "one legend entry per series, not per run"
    assert len([t for t in fig.data if t.name == "decode"]) == 2


def test_bad_inputs_are_named(tiny):
    with pytest.raises(ValueError, match="prompts must be"):
        timeline.simulate([], 3, num_blocks=10)
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        timeline.simulate([3, "abc"], 3, num_blocks=10)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        timeline.simulate([0], 3, num_blocks=10)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        timeline.simulate([[1], []], 3, num_blocks=10)
    with pytest.raises(ValueError, match="max_tokens: give one int or one per prompt"):
        timeline.simulate([3, 4], [1, 2, 3], num_blocks=10)
    with pytest.raises(ValueError, match="max_tokens"):
        timeline.simulate([3], 0, num_blocks=10)
    with pytest.raises(ValueError, match=r"prompts\[1\].*max_model_len=16"):
        timeline.simulate([3, 14], 4, num_blocks=10, max_model_len=16)
    with pytest.raises(ValueError, match=r"prompts\[0\].*the pool has 2"):
        timeline.simulate([20], 4, num_blocks=2)
    with pytest.raises(ValueError, match="without chunked_prefill"):
        timeline.simulate([20], 4, num_blocks=20, chunked_prefill=False, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="policy"):
        timeline.simulate([3], 4, num_blocks=20, policy="fifo")
    engine = LLMEngine(tiny, None, num_blocks=20, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="prompts must be"):
        timeline.record(engine, [])
    with pytest.raises(ValueError, match="prompts must be"):
        timeline.record(engine, "one text")
    with pytest.raises(ValueError, match="sampling_params"):
        timeline.record(engine, [[1, 2]], [SamplingParams(), SamplingParams()])
    steps = timeline.simulate([3], 2, num_blocks=10)
    with pytest.raises(ValueError, match="steps is empty"):
        timeline.figure([])
    with pytest.raises(TypeError, match="steps must be a list of timeline.Step"):
        timeline.figure(steps[0])
    with pytest.raises(ValueError, match="max_num_seqs"):
        timeline.figure(steps, max_num_seqs=0)
    with pytest.raises(ValueError, match="traces must be"):
        timeline.compare({})
    with pytest.raises(ValueError, match=r"traces\['a'\] is empty"):
        timeline.compare({"a": []})
