"""llmu's SmolLM2 against transformers' LlamaForCausalLM loaded from the same GGUF file.

Both dequantize the same Q4_1/Q8_0 blocks to the same float32 weights (test_llama checks they are
equal bit for bit through llmu's path), so every difference in the logits is float32 rounding in a
different order of operations (fused SDPA kernels, RoPE tables computed in float64 vs float32).
Over 30 layers that stays far below the gaps between competing logits: we require top-1
agreement at every position and a max absolute logit difference below 2e-3 (logits of this model
are O(10-30); measured about 1e-4).
"""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.models import generate, model_path

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon. He said:",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Les élèves ont étudié la Révolution française et 日本の歴史 pendant 3 semaines.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]

MAX_ABS_LOGIT_DIFF = 2e-3


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


def test_logits_match_transformers(smollm2, hf_model):
    model, tok = smollm2
    worst, agree, total = 0.0, 0, 0
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.inference_mode():
            ours = model(ids).logits
            theirs = hf_model(ids).logits
        worst = max(worst, (ours - theirs).abs().max().item())
        agree += (ours.argmax(-1) == theirs.argmax(-1)).sum().item()
        total += ids.shape[1]
    print(f"\nparity over {total} positions: max |logit diff| = {worst:.2e}, top-1 agreement = {agree}/{total}")
    assert agree == total
    assert worst < MAX_ABS_LOGIT_DIFF


def test_hidden_states_match_transformers(smollm2, hf_model):
    model, tok = smollm2
    ids = torch.tensor([tok.encode(PROMPTS[1])])
    with torch.inference_mode():
        ours = model(ids, output_hidden_states=True).hidden_states
        theirs = hf_model(ids, output_hidden_states=True).hidden_states
    assert len(ours) == len(theirs) == 31
    # hidden states grow to O(100) in the middle layers (outlier channels): compare relative to that
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-3 * b.abs().max().item(), rtol=1e-4)


def test_greedy_tokens_match_transformers(smollm2, hf_model):
    model, tok = smollm2
    ids = tok.encode(PROMPTS[1])
    ours = generate(model, tok, ids, 32, stop_on_eos=False).ids
    with torch.inference_mode():
        theirs = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=2)
    theirs = theirs[0, len(ids):].tolist()
    print(f"\n32 greedy tokens: {tok.decode(ours)!r}")
    assert ours == theirs


def test_chat_answer_matches_transformers(smollm2, hf_model):
    model, tok = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours = generate(model, tok, messages, 32)
    ids = tok.encode(tok.apply_chat_template(messages))
    with torch.inference_mode():
        theirs = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=32, do_sample=False, eos_token_id=2, pad_token_id=2)
    assert ours == "The capital of France is Paris."
    assert tok.decode(theirs[0, len(ids):], skip_special_tokens=True) == ours
