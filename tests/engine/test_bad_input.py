"""Bad requests are refused by ``add_request`` (and ``stream``, ``generate``, ``chat``) when made.

A token id outside the model's vocabulary is the case that matters: accepted, it would fail inside
a batched step (an ``IndexError`` on a CPU, a device-side assert on a GPU) and take every other
request of that step down with it. On a tiny random model (vocabulary 97).
"""

from __future__ import annotations

import io

import pytest
import torch

from llmu.engine import LLMEngine, SamplingParams
from llmu.engine.chat import chat
from llmu.models import SamplingParams as ModelSamplingParams, tiny_llama

VOCAB = 97


@pytest.fixture
def engine():
    model = tiny_llama(0, scale=0.3, max_position_embeddings=256, eos_token_id=96)
    assert model.config.vocab_size == VOCAB
    return LLMEngine(model, None, num_blocks=64, block_size=4, max_model_len=128)


@pytest.mark.parametrize("prompt, match", [
    ([1, VOCAB], rf"prompt\[1\] = {VOCAB} is not a token id of this model: "
                 rf"ids must be in \[0, vocab_size\) = \[0, {VOCAB}\)"),
    ([-1, 5], r"prompt\[0\] = -1 is not a token id of this model"),
    (torch.tensor([4, 5, 1000]), r"prompt\[2\] = 1000 is not a token id"),
    (torch.tensor([[4, -7]]), r"prompt\[1\] = -7 is not a token id"),
    ([], "prompt is empty"),
    (torch.zeros(0, dtype=torch.long), "prompt is empty"),
])
def test_add_request_refuses_bad_token_ids(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, SamplingParams(max_tokens=4))
    assert not engine.has_unfinished(), "a refused request must not be queued"


def test_add_request_refuses_bad_types(engine):
    with pytest.raises(TypeError, match="prompt must be a str, a list of chat messages, or a list/tensor of token ids"):
        engine.add_request([1.5, 2.0])
    with pytest.raises(TypeError, match="prompt must hold integer token ids, got a tensor of dtype float32"):
        engine.add_request(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="params must be an llmu.engine.SamplingParams, got SamplingParams"):
        engine.add_request([1, 2], ModelSamplingParams())  # the model's, without max_tokens


def test_params_assigned_after_construction_are_checked(engine):
    params = SamplingParams(max_tokens=4, temperature=1.0)
    params.top_p = 0.0
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        engine.add_request([1, 2], params)
    params = SamplingParams(max_tokens=4)
    params.max_tokens = -1
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        engine.add_request([1, 2], params)


def test_stream_and_generate_refuse_at_the_call_and_queue_nothing(engine):
    with pytest.raises(ValueError, match=rf"prompts\[1\]: prompt\[0\] = {VOCAB} is not a token id"):
        engine.stream([[1, 2], [VOCAB]], SamplingParams(max_tokens=4))  # no next(): the call raises
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt\[1\] = -3 is not a token id"):
        engine.generate([[1, -3], [4, 5]], SamplingParams(max_tokens=4))
    assert not engine.has_unfinished()
    # valid prompts still stream, and are queued when the first event is asked for
    events = engine.stream([[1, 2], [3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert not engine.has_unfinished()
    done = [e for e in events if e.finished]
    assert len(done) == 2 and all(len(engine.output(e.request_id).outputs[0].token_ids) == 3 for e in done)


def test_chat_checks_its_params_before_the_first_prompt(engine):
    """Inside the loop a ValueError means "the conversation no longer fits"; a bad parameter must not
    be mistaken for that, turn after turn: it is refused before anything is read."""
    inp, out = io.StringIO("Hello\n"), io.StringIO()
    params = SamplingParams(max_tokens=8)
    params.temperature = -1.0
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        chat(engine.model, None, params=params, inp=inp, out=out, engine=engine)
    with pytest.raises(TypeError, match="params must be an llmu.engine.SamplingParams, got SamplingParams"):
        chat(engine.model, None, params=ModelSamplingParams(), inp=inp, out=out, engine=engine)
    with pytest.raises(TypeError, match="engine must be an llmu.engine.LLMEngine or None, got str"):
        chat(engine.model, None, inp=inp, out=out, engine="engine")
    assert inp.tell() == 0 and out.getvalue() == ""
