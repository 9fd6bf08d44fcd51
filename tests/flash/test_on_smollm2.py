"""SmolLM2 with the FlashAttention kernel as its attention backend gives the greedy tokens of the
default "sdpa" backend, and logits within float32 rounding of it (the two sum the same products
in a different order: ~1e-5 per layer, ~1e-4 after 30 layers on logits of size ~40; 1e-3 keeps a
margin below the gap between the best and second-best logit, so the greedy tokens must agree).
"""

import pytest
import torch

import llmu.flash  # noqa: F401  (registers the "flash" backend)
from llmu.models import generate

pytestmark = [pytest.mark.slow, pytest.mark.kernels]


@pytest.fixture
def model_tok(smollm2, kdev):
    model, tok = smollm2
    if model.device.type != kdev.type:
        from llmu.models import load_model

        model = load_model(dtype=torch.float32, device=kdev)
    before = model.attention_backend.name
    yield model, tok
    model.set_attention(before)   # the session's model is shared: put its backend back


def test_flash_backend_gives_sdpa_greedy_tokens(model_tok):
    model, tok = model_tok
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    model.set_attention("sdpa")
    ids = torch.tensor([tok.encode("FlashAttention keeps the scores on chip because")], device=model.device)
    with torch.no_grad():
        want_logits = model(ids).logits
    want = str(generate(model, tok, prompt, max_new_tokens=8))
    model.set_attention("flash")
    with torch.no_grad():
        got_logits = model(ids).logits
    got = str(generate(model, tok, prompt, max_new_tokens=8))
    torch.testing.assert_close(got_logits, want_logits, atol=1e-3, rtol=0)
    assert got == want, (got, want)
