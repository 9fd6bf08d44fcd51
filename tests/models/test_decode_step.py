"""``llmu.models.decode_step``: the decode step in few calls computes what the modules compute, and
generation uses it only for a model it reproduces exactly.

Tolerances: the step sums each norm and each attention row in the order of its own kernel
(``F.rms_norm``, bmm + softmax) rather than the modules' (eight small ops, sdpa), so logits agree
to float32 rounding, not bit for bit: ``atol=rtol=1e-4`` on logits of size 1-40. RoPE is the same
expression, rearranged without changing a rounding.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from llmu.bench.machine import Threads as threads
from llmu.models import KVCache, decode_step, generate_ids, llama
from llmu.models.decode_step import DecodeStep, unsupported
from llmu.models.generate import GenerationStats
from llmu.models.llama import Linear, tiny_llama

#: big enough that every projection is split over two threads (llama._SPLIT_GEMV_MIN_WEIGHTS)
MID = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
           vocab_size=300, max_position_embeddings=256)


def both_paths(model, prompt: list[int], feeds: list[list[int]], pack: bool = False):
    """Logits of the modules and of the step for ``prompt`` (through the modules, in both caches)
    and then each of ``feeds``; returns the pairs and both caches."""
    ref, fast = KVCache.for_model(model, 1, 96), KVCache.for_model(model, 1, 96)
    step = DecodeStep(model, pack=pack)
    pairs = []
    with torch.inference_mode():
        for cache in (ref, fast):
            model(torch.tensor([prompt]), cache=cache)
        for ids in feeds:
            pairs.append((model(torch.tensor([ids]), cache=ref).logits[0], step(ids, fast)))
    return pairs, ref, fast


CONFIGS = {
    "tiny (F.linear)": {},
    "mid (split products)": MID,
    "mid, one kv head": {**MID, "num_key_value_heads": 1},
    "mid, no GQA": {**MID, "num_key_value_heads": 8},
    "with biases": {**MID, "attention_bias": True, "attention_out_bias": True},
    "NoPE": {**MID, "position_embedding": "none"},
    "llama3 rope scaling": {**MID, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
}


needs_onednn = pytest.mark.skipif(decode_step.packing_unavailable() is not None,
                                 reason=f"packing: {decode_step.packing_unavailable()}")


@pytest.mark.parametrize("pack", [False, pytest.param(True, marks=needs_onednn)], ids=["split", "packed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_token_and_a_few_tokens_give_the_modules_logits(name, pack):
    model = tiny_llama(seed=3, scale=0.1, **CONFIGS[name])
    if name == "with biases":
        with torch.no_grad():
            for mod in model.modules():
                if isinstance(mod, Linear) and mod.bias is not None:
                    mod.bias.normal_(0, 0.1)
    # one token at a time, then verification passes of 2, 5 and 8 tokens (causal among themselves;
    # packed: 5 and 8 go through oneDNN's copy), and 9 (more than SPLIT_GEMV_MAX_ROWS: F.linear)
    feeds = [[5], [17], [40, 41], [7, 8, 9, 10, 11], list(range(60, 68)), [1], list(range(20, 29))]
    with threads(2):
        pairs, ref, fast = both_paths(model, [3, 1, 4, 1, 5, 9, 2, 6], feeds, pack)
    for ids, (want, got) in zip(feeds, pairs):
        assert got.shape == want.shape == (len(ids), model.config.vocab_size)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, ids=ids: f"{len(ids)} token(s) after the prompt: {m}")
    assert fast.length == ref.length == 8 + sum(map(len, feeds))
    for layer in range(model.config.num_hidden_layers):  # the step stored the same keys and values
        for a, b in ((ref.k[layer], fast.k[layer]), (ref.v[layer], fast.v[layer])):
            torch.testing.assert_close(b[:, :, : ref.length], a[:, :, : ref.length], atol=1e-4, rtol=1e-4)


def test_the_step_and_the_modules_take_turns_on_one_cache():
    model = tiny_llama(seed=1, **MID)
    ref, shared = KVCache.for_model(model, 1, 64), KVCache.for_model(model, 1, 64)
    step = DecodeStep(model)
    with threads(2), torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), cache=ref)
        model(torch.tensor([[1, 2, 3]]), cache=shared)
        for i, token in enumerate([4, 5, 6, 7]):
            want = model(torch.tensor([[token]]), cache=ref).logits[0]
            got = step(token, shared) if i % 2 == 0 else model(torch.tensor([[token]]), cache=shared).logits[0]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert shared.length == ref.length == 7


@pytest.mark.slow
def test_generation_decodes_through_the_step_with_the_modules_tokens(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.encode("The three primary colours are")
    runs = {}
    for on in (True, False):
        stats = GenerationStats()
        with contextlib.nullcontext() if on else decode_step.disabled():
            runs[on] = (list(generate_ids(model, prompt, 32, stats=stats)), stats.decode_path)
    assert runs[True][1] == "decode_step" and runs[False][1] == "modules"
    assert runs[True][0] == runs[False][0], "the step's greedy tokens differ from the modules'"
    assert decode_step.ENABLED, "disabled() must restore the switch"


def _patched_class(model):
    original = llama.Attention.forward
    llama.Attention.forward = lambda self, *a, **k: original(self, *a, **k)
    return lambda: setattr(llama.Attention, "forward", original)


def _instance_forward(model):
    mlp = model.layers[0].mlp
    mlp.forward = mlp.forward  # an instance attribute shadows the class's method
    return lambda: delattr(mlp, "forward")


def _hook(model):
    return model.layers[1].self_attn.register_forward_hook(lambda *a: None).remove


def _global_hook(model):
    return torch.nn.modules.module.register_module_forward_hook(lambda *a: None).remove


def _backend(model):
    from llmu.models.backends import register_attention_backend, sdpa_attention

    register_attention_backend("test-decode-step", lambda q, k, v, **kw: sdpa_attention(q, k, v, **kw), replace=True)
    model.set_attention("test-decode-step")
    return lambda: model.set_attention("sdpa")


class Int8Like(Linear):  # a replaced projection of another class
    pass


def _replaced(model):
    old = model.layers[0].mlp.up_proj
    new = Int8Like(old.in_features, old.out_features, weight=old.weight.detach().clone())
    model.layers[0].mlp.up_proj = new
    return lambda: setattr(model.layers[0].mlp, "up_proj", old)


def _function(model):
    original = llama.rms_norm
    llama.rms_norm = lambda *a, **k: original(*a, **k)
    return lambda: setattr(llama, "rms_norm", original)


CHANGES = {  # what the step does not reproduce -> a word of the reason it gives
    "a patched class forward": (_patched_class, "Attention.forward"),
    "an instance's own forward": (_instance_forward, "MLP.forward"),
    "a forward hook": (_hook, "layers.1.self_attn has a forward hook"),
    "a global forward hook": (_global_hook, "global forward hook"),
    "another attention backend": (_backend, "test-decode-step"),
    "a replaced projection": (_replaced, "Int8Like"),
    "a replaced function": (_function, "rms_norm"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_anything_the_step_does_not_reproduce_sends_generation_through_the_modules(change):
    make, words = CHANGES[change]
    model = tiny_llama(seed=2)
    assert unsupported(model) is None
    undo = make(model)
    try:
        why = unsupported(model)
        assert why is not None and words in why, f"{change}: reason {why!r} should mention {words!r}"
        with pytest.raises(ValueError, match="model: "):
            DecodeStep(model)
        stats = GenerationStats()
        list(generate_ids(model, [1, 2, 3], 3, stats=stats))
        assert stats.decode_path == "modules"
    finally:
        undo()
    assert unsupported(model) is None


def test_a_hook_a_learner_adds_runs_on_every_decode_step():
    model = tiny_llama(seed=2)
    calls = []
    handle = model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        list(generate_ids(model, [1, 2, 3], 4))
    finally:
        handle.remove()
    assert len(calls) == 4, "the prompt's pass and three decode steps should each call the hook"


def test_models_and_caches_of_other_kinds_are_declined():
    assert "rope_layout" in unsupported(tiny_llama(rope_layout="interleaved"))
    assert "bfloat16" in unsupported(tiny_llama().to(torch.bfloat16))
    model = tiny_llama()
    assert "batch of 2" in unsupported(model, KVCache.for_model(model, 2, 16))
    assert unsupported(model, KVCache.for_model(model, 1, 16)) is None


def test_bad_calls_are_refused():
    model = tiny_llama()
    step = DecodeStep(model)
    cache = KVCache.for_model(model, 1, 4)
    with pytest.raises(ValueError, match="tokens is empty"):
        step([], cache)
    step([1, 2, 3], cache)
    with pytest.raises(ValueError, match="max_len=4"):
        step([4, 5], cache)
    assert cache.length == 3, "a refused call must not advance the cache"
    with pytest.raises(ValueError, match="length must be an int in 3..4"):
        cache.advance(2)


@needs_onednn
def test_speculative_verification_packs_only_when_its_passes_are_long_enough():
    from llmu.spec.decode import speculative_generate
    from llmu.spec.drafts import NGramDraft

    model = tiny_llama(seed=4, **MID)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    plain = list(generate_ids(model, prompt, 24))
    for gamma, packed in ((1, False), (2, False), (3, True), (6, True)):
        out = speculative_generate(model, NGramDraft(), prompt, 24, gamma=gamma)
        assert out.stats.packed is packed, f"gamma {gamma}: passes of {gamma + 1} tokens"
        assert out.tokens == plain, f"gamma {gamma}: speculative greedy tokens differ from plain decoding's"
        assert out.stats.setup_s >= 0


def test_pack_must_be_a_bool():
    with pytest.raises(TypeError, match="pack must be True or False"):
        DecodeStep(tiny_llama(), pack="yes")


def test_a_model_in_training_samples_through_the_step_and_trains_on():
    from llmu.models import make_trainable

    model = make_trainable(tiny_llama(**MID).config, seed=5, std=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = GenerationStats()
    with threads(2):
        fast = list(generate_ids(model, [1, 2, 3], 8, stats=stats))
        with decode_step.disabled():
            slow = list(generate_ids(model, [1, 2, 3], 8))
    assert stats.decode_path == "decode_step" and fast == slow
    before = model.layers[0].mlp.up_proj.weight.detach().clone()
    model(torch.tensor([[1, 2, 3, 4]])).logits.sum().backward()   # gradients still flow after sampling
    opt.step()
    assert not torch.equal(model.layers[0].mlp.up_proj.weight, before)


def test_the_steps_rope_is_apply_ropes_half_layout_bit_for_bit():
    from llmu.layers.reference import apply_rope

    model = tiny_llama(**MID)
    cos, sin = model.rope_tables(37, 5)                                  # (5, D/2)
    x = torch.randn(5, 10, MID["head_dim"], generator=torch.Generator().manual_seed(0))   # (T, heads, D)
    got = DecodeStep._rotate(x, *DecodeStep._rope_tables(cos, sin))
    want = apply_rope(x.transpose(0, 1), cos, sin, "half").transpose(0, 1)   # (heads, T, D) in apply_rope
    assert torch.equal(got, want)


def test_last_gives_the_last_tokens_logits_only():
    model = tiny_llama(0, **MID)
    step = DecodeStep(model)
    a, b = KVCache.for_model(model, 1, 32), KVCache.for_model(model, 1, 32)
    every, last = step([3, 1, 4, 1, 5], a), step([3, 1, 4, 1, 5], b, last=True)
    assert last.shape == (1, every.shape[1])
    # the head's product of one row and of five sum in orders the BLAS picks per shape: float32 rounding
    torch.testing.assert_close(last[0], every[-1], rtol=1e-5, atol=1e-5)
    assert a.length == b.length == 5 and torch.equal(a.k[1][:, :, :5], b.k[1][:, :, :5])
