"""The 4-bit draft's products and step (``llmu.spec.quantized_step``) and the draft built on them.

- ``Int4Product`` computes ``x W^T`` with ``W`` the weights its ``QuantizedTensor`` stands for, for
  each way module 10 writes one (integer zero point, symmetric, GGUF Q4_1's float minimum), with
  group sizes 32 and 64 and a ragged number of rows; ``Int8Product`` likewise for per-row int8;
- ``QuantizedStep`` gives the logits of the model whose weights are replaced by their 4-bit (blocks)
  and 8-bit (head) values, up to the bf16 rounding of its activations;
- ``QuantizedDraft`` makes speculative decoding emit exactly plain greedy decoding's tokens;
- bad inputs are refused with the reason, before a kernel could read past a buffer.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmu.kvcache.reference import decode_cached
from llmu.models import KVCache
from llmu.models.decode_step import DecodeStep
from llmu.models.llama import tiny_llama
from llmu.models.sampling import SamplingParams
from llmu.quant.formats import dequantize, quantize, quantize_minmax
from llmu.spec.decode import speculative_generate
from llmu.spec.drafts import QuantizedDraft
from llmu.spec.quantized_step import Int4Product, Int8Product, QuantizedStep, quantized_unavailable

pytestmark = pytest.mark.skipif(quantized_unavailable() is not None, reason=f"{quantized_unavailable()}")

#: every size a multiple of 32 (the kernel's smallest group) and every output count of 16
MID = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
           vocab_size=300, max_position_embeddings=256)


def _bf16_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x W^T`` in float64 from the bf16 ``x`` the kernel reads (its own rounding left out)."""
    return (x.double() @ w.double().T)


FORMATS = {
    "integer zero": lambda w, g: quantize(w, 4, group_size=g),
    "symmetric": lambda w, g: quantize(w, 4, symmetric=True, group_size=g),
    "float minimum (Q4_1)": lambda w, g: quantize_minmax(w, 4, group_size=g),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n,k,g", [(16, 32, 32), (48, 96, 32), (960, 576, 32), (64, 128, 64)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_product_is_the_dequantized_weights_product(fmt, n, k, g, rows):
    gen = torch.Generator().manual_seed(n * k + rows)
    w = torch.randn(n, k, generator=gen) * 0.05 + 0.01
    qt = FORMATS[fmt](w, g)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    got = Int4Product(qt)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # The kernel computes w = (q - 8) scale + zero' with scale and zero' rounded to bf16 (unit
    # roundoff 2^-8: a weight moves by at most 2^-8 (8 |scale| + |zero'|)), accumulates in float32
    # and rounds the result to bf16 (2^-8 of it). A wrong code, nibble order or zero convention
    # moves a dot product by a whole step, ~|x| * scale per weight: far more than this.
    want = _bf16_reference(x, dequantize(qt))
    s = qt.scale
    zero = qt.offset + 8 * s if qt.offset is not None else (8 - qt.zero) * s
    weight_slack = 2.0**-8 * (8 * s.abs() + zero.abs()).repeat_interleave(g, 1)       # (N, K)
    bound = x.double().abs() @ weight_slack.double().T + 2.0**-8 * want.abs() + 1e-6
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() / bound).max()


def test_a_q4_1_tensor_of_the_model_file_is_repacked_exactly():
    """A real block weight of the course's file: its own codes (``from_gguf``) and the ones
    ``quantize_minmax`` finds again from the dequantized floats give the same product."""
    from llmu.models.gguf_file import GGUFFile
    from llmu.quant.formats import from_gguf

    with GGUFFile(None) as f:
        qt = from_gguf(f.tensor("blk.3.attn_v.weight"))
    again = quantize_minmax(dequantize(qt), 4, group_size=32)
    assert torch.equal(again.codes, qt.codes)
    x = torch.randn(2, qt.shape[1], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert torch.equal(Int4Product(qt)(x), Int4Product(again)(x))


@pytest.mark.parametrize("n,k", [(1, 16), (17, 96), (300, 256)])
def test_int8_product_is_the_dequantized_weights_product(n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(4, k, generator=gen).to(torch.bfloat16)
    got = Int8Product(w)(x)
    qt = quantize(w, 8, symmetric=True, granularity="channel")
    want = _bf16_reference(x, dequantize(qt))
    # bf16 scales (2^-8 of each weight) and a bf16 result (2^-8 of it), as for int4
    bound = 2.0**-8 * (x.double().abs() @ dequantize(qt).abs().double().T + want.abs()) + 1e-6
    assert ((got.double() - want).abs() <= bound).all()


def _fake_quantized(model):
    """A copy of ``model`` whose projections hold the values the step's codes stand for."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for layer in ref.layers:
            a, m = layer.self_attn, layer.mlp
            for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
                p.weight.copy_(dequantize(quantize_minmax(p.weight, 4, group_size=32)))
        ref.lm_head.weight.copy_(dequantize(quantize(ref.lm_head.weight, 8, symmetric=True, granularity="channel")))
    return ref


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("config", [MID, {**MID, "num_key_value_heads": 8}, {**MID, "position_embedding": "none"}],
                         ids=["gqa", "mha", "nope"])
def test_the_step_computes_the_model_with_quantized_weights(seed, config):
    model = tiny_llama(seed, scale=0.1, **config)
    step, ref = QuantizedStep(model), DecodeStep(_fake_quantized(model))
    full = DecodeStep(model)
    caches = [KVCache.for_model(model, 1, 96) for _ in range(3)]
    for ids in (list(range(1, 40)), [5], [7, 8, 9]):
        got, want, exact = step(ids, caches[0]), ref(ids, caches[1]), full(ids, caches[2])
        assert got.dtype == torch.float32 and got.shape == want.shape
        scale = want.std()
        # bf16 activations keep 8 significant bits; over two layers and their residual sums the
        # logits moved by at most 8% of their spread here. The 4-bit weights themselves move them
        # by more than one spread (``exact``): a wrong fused split, scale or cache write shows.
        assert (got - want).abs().max() <= 0.2 * scale, ((got - want).abs().max() / scale)
        assert (exact - want).abs().max() > 0.5 * scale  # the check above can tell quantization apart
    assert caches[0].length == caches[1].length == 43


def test_last_gives_the_last_row_only():
    model = tiny_llama(0, scale=0.1, **MID)
    step = QuantizedStep(model)
    a, b = KVCache.for_model(model, 1, 64), KVCache.for_model(model, 1, 64)
    every, last = step([1, 2, 3, 4], a), step([1, 2, 3, 4], b, last=True)
    assert last.shape == (1, every.shape[1])
    # one row or four through the int8 head: the kernel may sum in another order, and rounds to bf16
    torch.testing.assert_close(last[0], every[-1], rtol=2.0**-7, atol=1e-3)


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_speculative_decoding_with_the_quantized_draft_is_plain_greedy_decoding(gamma):
    model = tiny_llama(0, scale=0.1, **MID)
    prompt = [5, 9, 3, 7, 5, 9, 3]
    out = speculative_generate(model, QuantizedDraft(model), prompt, 30, gamma=gamma)
    assert out.tokens == decode_cached(model, prompt, 30).tokens
    # a random 2-layer model at 4 bits is a rough copy (the logits move by about their spread), yet
    # it guesses far better than chance, 1/300
    assert out.stats.acceptance_rate > 0.1


def test_sampling_with_the_quantized_draft_gives_distributions_and_tokens():
    model = tiny_llama(0, scale=0.1, **MID)
    draft = QuantizedDraft(model)
    out = speculative_generate(model, draft, [5, 9, 3], 12, gamma=3, params=SamplingParams(temperature=1.0, seed=1))
    assert len(out.tokens) == 12 and all(0 <= t < 300 for t in out.tokens)
    draft.begin(32)
    tokens, q = draft.propose([5, 9, 3], 3, SamplingParams(temperature=1.0, seed=0), torch.Generator().manual_seed(0))
    assert len(tokens) == 3 and q.shape == (3, 300) and torch.allclose(q.sum(-1), torch.ones(3))


def test_bad_inputs_are_refused_with_the_reason():
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="4-bit"):
        Int4Product(quantize(w, 8, group_size=32))
    with pytest.raises(ValueError, match="groups of"):
        Int4Product(quantize(w, 4, granularity="channel"))
    with pytest.raises(ValueError, match="multiple of 16"):
        Int4Product(quantize_minmax(torch.randn(17, 64), 4, group_size=32))
    with pytest.raises(TypeError, match="QuantizedTensor"):
        Int4Product(w)
    with pytest.raises(ValueError, match="multiple of 16"):
        Int8Product(torch.randn(4, 24))   # the kernel would read past the row
    with pytest.raises(TypeError, match="2-D"):
        Int8Product(torch.randn(4))
    model = tiny_llama(0, **MID)
    with pytest.raises(ValueError, match="group_size must be one of"):
        QuantizedStep(model, group_size=48)
    with pytest.raises(ValueError, match="must divide"):
        QuantizedStep(tiny_llama(0), group_size=32)          # hidden size 48
    with pytest.raises(ValueError, match="float32"):
        QuantizedStep(tiny_llama(0, **MID).to(torch.float64))
    with pytest.raises(ValueError, match="bias"):
        QuantizedDraft(tiny_llama(0, **MID, attention_bias=True))
    with pytest.raises(RuntimeError, match="begin"):
        QuantizedDraft(model).propose([1, 2], 2, SamplingParams())


def test_the_draft_reads_a_fraction_of_the_bytes():
    model = tiny_llama(0, **MID)
    step = QuantizedStep(model)
    floats = sum(p.numel() * 4 for name, p in model.named_parameters() if p.ndim == 2 and "embed" not in name)
    # 4 bits and two bf16 numbers per 32 weights in the blocks (5 bits), 8 bits and a bf16 per row in the head
    assert floats / 7 < step.weight_bytes < floats / 5, (step.weight_bytes, floats)
