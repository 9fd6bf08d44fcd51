"""The serving engine: whatever the batching, chunking, caching or memory pressure, greedy output
equals one-request-at-a-time generation, and every request ends with a reason.

Most checks run on a tiny random model (2 layers, 4-position blocks, so a handful of tokens
already spans several blocks and a small pool forces preemption); the real model is used where
the tokenizer matters (stop strings, chat prompts) and for one end-to-end comparison. Greedy
decoding compares token ids exactly: a packed batch computes each row with the same weights, and
the float32 differences between batched and single-row matmuls (~1e-6) are far below the gaps
between the top two logits of these prompts.
"""

from __future__ import annotations

import pytest
import torch

from llmu.engine import LLMEngine, SamplingParams
from llmu.engine.scheduler import Scheduler, SchedulerConfig
from llmu.engine.sequence import Sequence
from llmu.models import LlamaModel, tiny_llama
from llmu.models.generate import generate, generate_ids
from llmu.paged import BlockManager


def tiny_model(seed=0) -> LlamaModel:
    return tiny_llama(seed, scale=0.3, max_position_embeddings=256, eos_token_id=96)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def prompts(n=10, seed=0, lo=1, hi=30):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 96, (k,), generator=g).tolist() for k in lens]


def reference(model, ps, max_tokens, eos=(96,)):
    return [list(generate_ids(model, p, max_tokens, eos_ids=eos)) for p in ps]


def strip_eos(ids, eos=96):
    return [t for t in ids if t != eos]


CONFIGS = {
    "continuous": dict(),
    "static": dict(policy="static", max_num_seqs=4),
    "tiny budget, chunked prefill": dict(max_num_batched_tokens=7),
    "no chunking": dict(chunked_prefill=False, max_num_batched_tokens=40),
    "no prefix caching": dict(prefix_caching=False),
    "reserve max_tokens": dict(reserve="max_tokens"),
    "reserve context": dict(reserve="context", max_model_len=64, num_blocks=60),
    "small pool: preemption": dict(num_blocks=14),
    "few sequences": dict(max_num_seqs=2),
    "reference attention": dict(attention="reference"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_output_equals_sequential_generation(tiny, name):
    kw = dict(num_blocks=200, block_size=4, max_model_len=128)
    kw.update(CONFIGS[name])
    engine = LLMEngine(tiny, None, **kw)
    ps = prompts()
    outs = engine.generate(ps, SamplingParams(max_tokens=12))
    want = reference(tiny, ps, 12)
    for i, (o, w) in enumerate(zip(outs, want)):
        assert o.outputs[0].token_ids == strip_eos(w), f"request {i} differs from generate_ids under {name!r}"
        assert o.outputs[0].finish_reason in ("eos", "length")
        assert o.outputs[0].finish_reason == ("eos" if 96 in w else "length")
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0, "finished sequences must return every block"
    engine.block_manager.check_invariants()
    if name == "small pool: preemption":
        assert engine.stats.preemptions > 0, "a 14-block pool should have forced preemption"


@pytest.mark.parametrize("budget", [7, 64])
def test_the_runner_decode_step_equals_the_model_modules(tiny, budget):
    """The runner passes the stock model through DecodeStep.packed (prefill chunks and decode
    rows of several sequences, causal within a chunk); through the modules it must pick the same
    tokens, step for step."""
    from llmu.models import decode_step

    kw = dict(num_blocks=200, block_size=4, max_model_len=128, max_num_batched_tokens=budget)
    ps = prompts(8, seed=3)
    fast = LLMEngine(tiny, None, **kw)
    with decode_step.disabled():
        slow = LLMEngine(tiny, None, **kw)
    assert (fast.runner.step_path, slow.runner.step_path) == ("decode_step", "modules")
    got = [o.outputs[0].token_ids for o in fast.generate(ps, SamplingParams(max_tokens=10))]
    want = [o.outputs[0].token_ids for o in slow.generate(ps, SamplingParams(max_tokens=10))]
    assert got == want


def test_the_runner_uses_the_modules_for_a_model_with_a_hook(tiny):
    handle = tiny.layers[0].register_forward_hook(lambda *a: None)
    try:
        engine = LLMEngine(tiny, None, num_blocks=50, block_size=4, max_model_len=64)
    finally:
        handle.remove()
    assert engine.runner.step_path == "modules"


def test_chunked_prefill_splits_a_long_prompt(tiny):
    engine = LLMEngine(tiny, None, num_blocks=100, block_size=4, max_num_batched_tokens=8, max_model_len=128)
    p = prompts(1, seed=3, lo=40, hi=41)
    out = engine.generate(p, SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.stats.steps == 5 + 2, "40 prompt tokens in chunks of 8 (5 steps), then 2 decode steps"
    assert out[0].outputs[0].token_ids == reference(tiny, p, 3, eos=())[0]


def test_without_chunking_a_prompt_over_the_budget_is_refused(tiny):
    engine = LLMEngine(tiny, None, num_blocks=100, block_size=4, chunked_prefill=False, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.add_request(list(range(9)))


def test_prefix_cache_hits_on_a_shared_prompt(tiny):
    engine = LLMEngine(tiny, None, num_blocks=100, block_size=4, max_model_len=128)
    system = list(range(1, 17))  # four full blocks
    ps = [system + [20 + i, 30 + i] for i in range(4)]
    engine.generate(ps[:1], SamplingParams(max_tokens=4))
    engine.reset_stats()
    outs = engine.generate(ps[1:], SamplingParams(max_tokens=4))
    assert engine.stats.prefix_cached_tokens == 3 * 16
    assert all(o.cached_tokens == 16 for o in outs)
    for o, w in zip(outs, reference(tiny, ps[1:], 4)):
        assert o.outputs[0].token_ids == strip_eos(w)


def test_same_prompt_twice_recomputes_only_the_last_token(tiny):
    engine = LLMEngine(tiny, None, num_blocks=100, block_size=4, max_model_len=128)
    p = list(range(1, 17))
    first = engine.generate([p], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    engine.reset_stats()
    again = engine.generate([p], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert again.cached_tokens == 15
    assert engine.stats.copies == 1, "the last prompt block is shared: writing its last position copies it"
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_parallel_samples_share_the_prompt_and_copy_on_write(tiny):
    engine = LLMEngine(tiny, None, num_blocks=100, block_size=4, max_model_len=128)
    p = list(range(1, 11))  # 10 tokens: the third block is half full and shared after the fork
    out = engine.generate([p], SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=5, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "three seeded samples should not all agree"
    assert engine.stats.copies >= 2, "each of two sisters copies the shared half-full block before writing"
    assert engine.stats.positions_computed == 10 + 3 * 7, "the prompt is computed once, not three times"
    same = LLMEngine(tiny, None, num_blocks=100, block_size=4).generate(
        [p], SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=5, ignore_eos=True))[0]
    assert [o.token_ids for o in same.outputs] == [o.token_ids for o in out.outputs], "seeded sampling must repeat"
    greedy = engine.generate([p], SamplingParams(max_tokens=6, n=2, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_static_batching_admits_nobody_until_the_batch_is_done(tiny):
    bm = BlockManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, policy="static"), bm)
    params = SamplingParams(max_tokens=3)
    seqs = [Sequence(0, 0, [1, 2, 3], 3, params) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [s for s, _ in batch.entries] == seqs[:2]
    sched.computed(batch)
    seqs[0].token_ids.append(5)
    seqs[1].token_ids.append(5)
    sched.finish(seqs[0], "eos")
    batch = sched.schedule()
    assert [s for s, _ in batch.entries] == [seqs[1]], "static batching must not admit while a member runs"
    sched.computed(batch)
    sched.finish(seqs[1], "eos")
    assert [s for s, _ in sched.schedule().entries] == [seqs[2]]


def test_continuous_batching_admits_as_soon_as_a_slot_frees(tiny):
    bm = BlockManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), bm)
    params = SamplingParams(max_tokens=3)
    seqs = [Sequence(0, 0, [1, 2, 3], 3, params) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    sched.computed(sched.schedule())
    for s in seqs[:2]:
        s.token_ids.append(5)
    sched.finish(seqs[0], "eos")
    batch = sched.schedule()
    assert [(s, n) for s, n in batch.entries] == [(seqs[1], 1), (seqs[2], 3)], \
        "the freed slot should go to the waiting request in the very next step, next to the decode"


def test_preempted_sequences_are_recomputed_not_lost(tiny):
    engine = LLMEngine(tiny, None, num_blocks=10, block_size=4, max_model_len=128)
    ps = prompts(6, seed=1, lo=8, hi=12)
    outs = engine.generate(ps, SamplingParams(max_tokens=16, ignore_eos=True))
    assert engine.stats.preemptions > 0
    assert sum(o.outputs[0].preemptions for o in outs) == engine.stats.preemptions
    for o, w in zip(outs, reference(tiny, ps, 16, eos=())):
        assert o.outputs[0].token_ids == w and o.outputs[0].finish_reason == "length"


def test_requests_that_can_never_fit_are_refused(tiny):
    engine = LLMEngine(tiny, None, num_blocks=10, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="KV pool has 10"):
        engine.add_request(list(range(30)), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([1], params={"max_tokens": 3})
    with pytest.raises(ValueError, match="sampling_params"):
        engine.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(ValueError, match=r"prompts\[2\]: .*max_model_len=64"):
        engine.generate([[1, 2], [3], list(range(70))], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished(), "one bad prompt must not leave the good ones before it queued"


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n must"), (dict(stop=[""]), "stop"),
    (dict(temperature=-1), "temperature"), (dict(ignore_eos=1), "ignore_eos"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(policy="fifo"), "policy"), (dict(reserve="all"), "reserve"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_model_len=10_000), "max_model_len"), (dict(attention="cuda"), "impl"),
])
def test_bad_engine_arguments(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine = LLMEngine(tiny, None, num_blocks=10, block_size=4, **kwargs)
        engine.generate([[1, 2]], SamplingParams(max_tokens=2))


def test_abort_finishes_with_a_reason(tiny):
    engine = LLMEngine(tiny, None, num_blocks=50, block_size=4)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort(rid)
    assert engine.output(rid).outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0


# -- the real model ---------------------------------------------------------------------------------

CHATS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.", "What is 2+2?"]


@pytest.mark.slow
def test_engine_equals_generate_on_smollm2(smollm2):
    model, tok = smollm2
    msgs = [[{"role": "user", "content": q}] for q in CHATS]
    engine = LLMEngine(model, tok, num_blocks=64, max_model_len=512, max_num_batched_tokens=64)
    outs = engine.generate(msgs, SamplingParams(max_tokens=20))
    for m, o in zip(msgs, outs):
        ref = generate(model, tok, m, 20)
        assert o.text == str(ref), f"engine and generate() disagree on {m[0]['content']!r}"
        assert o.outputs[0].finish_reason == ref.finish_reason


@pytest.mark.slow
def test_stop_strings_and_streaming_on_smollm2(smollm2):
    model, tok = smollm2
    engine = LLMEngine(model, tok, num_blocks=64, max_model_len=512)
    msgs = [{"role": "user", "content": "Name three colors."}]
    pieces = {}
    for ev in engine.stream([msgs, msgs], [SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, stop="2.")]):
        pieces.setdefault(ev.request_id, []).append(ev)
    texts = {rid: "".join(e.text for e in evs) for rid, evs in pieces.items()}
    full, cut = texts[0], texts[1]
    assert "2." in full and cut == full[: full.index("2.")], "a stop string cuts the text just before it"
    assert pieces[1][-1].finished and pieces[1][-1].finish_reason == "stop"
    assert engine.output(0).text == full


def test_static_batching_fills_its_batch_across_steps():
    """A batch whose prompts exceed one step's token budget is still formed whole before it runs."""
    bm = BlockManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, policy="static", max_num_batched_tokens=8), bm)
    params = SamplingParams(max_tokens=3)
    seqs = [Sequence(0, 0, list(range(10 * i, 10 * i + 6)), 6, params) for i in range(4)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert [(s, n) for s, n in first.entries] == [(seqs[0], 6), (seqs[1], 2)]
    sched.computed(first)
    seqs[0].token_ids.append(9)  # its prompt is done: it sampled a token
    second = sched.schedule()
    assert [(s, n) for s, n in second.entries] == [(seqs[0], 1), (seqs[1], 4), (seqs[2], 3)], \
        "the third member joins while the batch is formed (and the second finishes its prompt)"
    assert seqs[3] in sched.waiting, "the fourth request waits for the next batch"
