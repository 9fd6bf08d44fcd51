"""Bad input to generation is refused when the function is called, with a message that names it.

``generate_ids`` and ``stream_generate`` return generators: the model runs only when a token is
asked for, but the arguments are checked at the call. Token ids outside the vocabulary are the
important case: unchecked, they fail deep inside the embedding lookup (an ``IndexError`` on a CPU,
a device-side assert that breaks the CUDA context on a GPU). On the tiny random model
(``llmu.models.tiny_llama``, vocabulary 97, context 128).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from llmu import checks
from llmu.models import KVCache, SamplingParams, generate, stream_generate, tiny_llama
from llmu.models.generate import generate_ids

VOCAB = 97


@pytest.fixture(scope="module")
def model():
    m = tiny_llama()
    assert m.config.vocab_size == VOCAB
    return m


@pytest.mark.parametrize("prompt, match", [
    ([1, VOCAB], rf"prompt_ids\[1\] = {VOCAB} is not a token id of this model: "
                 rf"ids must be in \[0, vocab_size\) = \[0, {VOCAB}\)"),
    ([5, -1, 3], r"prompt_ids\[1\] = -1 is not a token id"),
    (torch.tensor([3, 1000]), r"prompt_ids\[1\] = 1000 is not a token id"),
    (torch.tensor([[3, -2]]), r"prompt_ids\[1\] = -2 is not a token id"),
    ([], "prompt_ids is empty"),
    (torch.zeros(0, dtype=torch.long), "prompt_ids is empty"),
    (torch.zeros(2, 3, dtype=torch.long), r"prompt_ids must be one sequence of token ids, shape \(T,\) or \(1, T\)"),
])
def test_generate_ids_refuses_bad_prompt_ids_at_the_call(model, prompt, match):
    with pytest.raises(ValueError, match=match):
        generate_ids(model, prompt, 3)  # no next(): the call itself raises


@pytest.mark.parametrize("prompt, match", [
    ([1.0, 2.0], r"prompt_ids must hold int token ids, got prompt_ids\[0\] = 1.0"),
    ([1, True], r"prompt_ids must hold int token ids, got prompt_ids\[1\] = True"),
    (torch.tensor([1.0, 2.0]), "prompt_ids must hold integer token ids, got a tensor of dtype float32"),
    ("hello", "prompt_ids must be a list or a 1-D integer tensor of token ids, got str"),
])
def test_generate_ids_refuses_prompt_ids_of_the_wrong_type(model, prompt, match):
    with pytest.raises(TypeError, match=match):
        generate_ids(model, prompt, 3)


def test_generate_ids_checks_its_other_arguments_at_the_call(model):
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        generate_ids(model, [1, 2], -1)
    with pytest.raises(TypeError, match="max_new_tokens must be an int >= 0, got 2.0"):
        generate_ids(model, [1, 2], 2.0)
    with pytest.raises(TypeError, match="max_new_tokens must be an int >= 0, got True"):
        generate_ids(model, [1, 2], True)
    with pytest.raises(ValueError, match="max_new_tokens: prompt .* exceeds the model's context of 128"):
        generate_ids(model, [1, 2], 127)
    with pytest.raises(TypeError, match="params must be a llmu.models.SamplingParams, got dict"):
        generate_ids(model, [1, 2], 3, {"temperature": 0.5})
    with pytest.raises(TypeError, match="eos_ids must be a list of int token ids, got 5"):
        generate_ids(model, [1, 2], 3, eos_ids=5)
    with pytest.raises(TypeError, match="eos_ids must be a list of int token ids"):
        generate_ids(model, [1, 2], 3, eos_ids=["2"])
    with pytest.raises(TypeError, match="stats must be a GenerationStats or None, got dict"):
        generate_ids(model, [1, 2], 3, stats={})
    with pytest.raises(TypeError, match="cache must be a llmu.models.KVCache or None, got dict"):
        generate_ids(model, [1, 2], 3, cache={})
    with pytest.raises(ValueError, match=r"max_new_tokens: prompt \(2\) \+ max_new_tokens \(3\) exceeds the "
                                         r"cache's free positions \(max_len=4, 0 used\) of 4 positions; "
                                         r"at most 2 new tokens fit"):
        generate_ids(model, [1, 2], 3, cache=KVCache.for_model(model, max_len=4))


def test_a_prompt_too_long_by_itself_is_named_not_max_new_tokens(model):
    """The argument at fault is the prompt when it alone exceeds the context (or the cache), whatever
    max_new_tokens is; each function names it as its caller wrote it."""
    long = [1] * 130                                   # the tiny model's context is 128
    with pytest.raises(ValueError, match=r"^prompt_ids: the prompt alone holds 130 tokens, more than the "
                                         r"model's context of 128 positions"):
        generate_ids(model, long, 5)
    with pytest.raises(ValueError, match=r"^prompt: the prompt alone holds 130 tokens"):
        generate(model, None, long, 5)
    with pytest.raises(ValueError, match=r"^prompt: the prompt alone holds 130 tokens"):
        stream_generate(model, None, long, 0)
    with pytest.raises(ValueError, match=r"^max_new_tokens: prompt \(120\) \+ max_new_tokens \(9\) exceeds "
                                         r"the model's context of 128 positions; at most 8 new tokens fit"):
        generate(model, None, [1] * 120, 9)
    assert len(generate(model, None, [1] * 120, 8, stop_on_eos=False).ids) == 8      # exactly full is fine
    with pytest.raises(ValueError, match=r"^prompt_ids: the prompt alone holds 5 tokens, more than the "
                                         r"cache's free positions \(max_len=4, 0 used\) of 4 positions"):
        generate_ids(model, [1] * 5, 0, cache=KVCache.for_model(model, max_len=4))


@pytest.mark.parametrize("field, value, match", [
    ("temperature", -0.5, "temperature must be a number >= 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_k", -1, "top_k must be an int >= 0"),
    ("min_p", 2.0, r"min_p must be in \[0, 1\]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a positive number"),
])
def test_sampling_parameters_are_checked_again_at_the_call(model, field, value, match):
    """SamplingParams checks itself when made; a field assigned afterwards is caught by the call."""
    params = SamplingParams(temperature=1.0)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=match):
        generate_ids(model, [1, 2], 3, params)
    with pytest.raises(ValueError, match=match):
        stream_generate(model, None, [1, 2], 3, params=params)


def test_stream_generate_checks_at_the_call(model):
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        stream_generate(model, None, [1, 2], -1)
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        stream_generate(model, None, [1, 2], 3, temperature=-1)
    with pytest.raises(ValueError, match=rf"prompt\[1\] = {VOCAB} is not a token id of this model"):
        stream_generate(model, None, [1, VOCAB], 3)
    with pytest.raises(ValueError, match="prompt is empty"):
        stream_generate(model, None, torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(TypeError, match="stop_on_eos must be a bool, got 'no'"):
        stream_generate(model, None, [1, 2], 3, stop_on_eos="no")
    with pytest.raises(TypeError, match="result must be a dict or None, got list"):
        stream_generate(model, None, [1, 2], 3, result=[])
    with pytest.raises(ValueError, match=r"prompt\[0\] = -5 is not a token id"):
        generate(model, None, [-5, 1], 3)


def test_valid_calls_still_generate_the_same_tokens(model):
    """The split into a checking call and a generator changes nothing for valid input."""
    ids = [3, 14, 15, 92, 65]
    gen = generate_ids(model, ids, 6, eos_ids=())
    assert iter(gen) is gen  # still a generator
    want = list(gen)
    assert len(want) == 6
    assert list(generate_ids(model, torch.tensor(ids), 6)) == want
    assert list(generate_ids(model, torch.tensor([ids]), 6)) == want
    assert list(generate_ids(model, tuple(ids), 6)) == want
    assert list(generate_ids(model, [np.int64(i) for i in ids], 6)) == want
    assert list(generate_ids(model, ids, 0)) == []
    result = {}
    assert list(stream_generate(model, None, ids, 6, result=result)) == []  # no tokenizer: no text
    assert result["generation"].ids == want


def test_ids_are_checked_once_per_call_not_per_token(model, monkeypatch):
    calls = []

    def counting(name, ids, vocab_size=None):
        calls.append(name)
        return checks.require_token_ids(name, ids, vocab_size)

    # the module, not the function of the same name that llmu.models exports
    monkeypatch.setattr(sys.modules["llmu.models.generate"], "require_token_ids", counting)
    out = list(generate_ids(model, [1, 2, 3], 12))
    assert len(out) == 12 and calls == ["prompt_ids"]
