"""The Triton kernels of llmu.layers inside SmolLM2: a forward with every RMSNorm, RoPE and SwiGLU
gate replaced by the kernels gives llmu's logits, and gradients through a real block match autograd
through the torch references.

Tolerances: the kernels and the references do the same fp32 arithmetic in a slightly different
order (row sums, the fused sigmoid), so each op differs by a few ulps; 30 layers deep that grows to
about 1e-4 on logits of size ~40 (measured). 1e-3 keeps a margin and is below the smallest gap
between the best and second-best logit on this prompt, which is why top-1 must also agree.

The model runs on ``kernel_device()``: the session's CPU model in Triton's interpreter, a copy
loaded on the GPU when the kernels are compiled.
"""

import pytest
import torch

import llmu  # noqa: F401
from llmu.layers import reference
from llmu.layers.kernels import rms_norm, rope, swiglu_fused

pytestmark = [pytest.mark.slow, pytest.mark.kernels]


@pytest.fixture(scope="module")
def model_tok(smollm2, kdev):
    """(model, tokenizer) with the model on the device the kernels take their tensors on."""
    model, tok = smollm2
    if model.device.type != kdev.type:
        from llmu.models import load_model

        model = load_model(dtype=torch.float32, device=kdev)
    return model, tok


def _block(x, layer, cos, sin, cfg, backend):
    b, t, _ = x.shape
    a = layer.self_attn
    h = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
    q = a.q_proj(h).view(b, t, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
    k = a.k_proj(h).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
    v = a.v_proj(h).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
    q, k = rope(q, k, cos, sin, cfg.rope_layout)  # in place, on the projections' outputs
    o = backend.fn(q, k, v, causal=True, scale=cfg.head_dim ** -0.5)
    x = x + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
    h = rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
    m = layer.mlp
    return x + m.down_proj(swiglu_fused(m.gate_proj(h), m.up_proj(h)))


def test_model_with_kernels_gives_llmu_logits(model_tok):
    model, tok = model_tok
    cfg = model.config
    ids = torch.tensor([tok.encode("Rotary embeddings turn pairs of channels")], device=model.device)
    cos, sin = model.rope_tables(0, ids.shape[1])
    with torch.no_grad():
        x = model.embed_tokens(ids)
        for layer in model.layers:
            x = _block(x, layer, cos, sin, cfg, model.attention_backend)
        logits = model.lm_head(rms_norm(x, model.norm.weight, model.norm.eps))
        expected = model(ids).logits
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_gradients_through_a_real_block(model_tok):
    model, _ = model_tok
    cfg = model.config
    layer = model.layers[5]
    cos, sin = model.rope_tables(0, 7)
    gen = torch.Generator(device="cpu").manual_seed(0)  # the same numbers on every machine
    x0 = torch.randn(2, 7, cfg.hidden_size, generator=gen, device="cpu").to(model.device)
    dy = torch.randn(2, 7, cfg.hidden_size, generator=gen, device="cpu").to(model.device)

    x = x0.clone().requires_grad_(True)
    _block(x, layer, cos, sin, cfg, model.attention_backend).backward(dy)

    def torch_block(x):  # the same block with the torch references (the model's own path)
        return layer(x, cos, sin, backend=model.attention_backend)[0]

    xr = x0.clone().requires_grad_(True)
    torch_block(xr).backward(dy)
    # One block, fp32: a few ulps per op on values of size ~10; 1e-4 relative + absolute.
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)

    # The gain of the first norm: its gradient sums over all 14 tokens (per-program partial sums).
    w = layer.input_layernorm.weight
    h = x0.reshape(-1, cfg.hidden_size)
    g = torch.randn(h.shape, generator=gen, device="cpu").to(model.device)
    wk = w.detach().clone().requires_grad_(True)
    wr = w.detach().clone().requires_grad_(True)
    rms_norm(h, wk, layer.input_layernorm.eps).backward(g)
    reference.rms_norm(h, wr, layer.input_layernorm.eps).backward(g)
    torch.testing.assert_close(wk.grad, wr.grad, atol=1e-4, rtol=1e-4)
