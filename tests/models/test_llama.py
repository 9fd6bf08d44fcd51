"""The decoder: KV cache, attention backends, RoPE layout, outputs, loading and caching."""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.attention.reference import attention as reference_attention
from llmu.models import KVCache, LlamaModel, load_model, register_attention_backend
from llmu.models.backends import attention_backends, sdpa_attention
from llmu.models.llama import Linear, tiny_llama
from llmu.models.loading import build_from_gguf, permute_rope_rows, unpermute_rope_rows

PROMPT = "The quick brown fox jumps over the lazy dog. In 2024, the capital of France"


@pytest.fixture(scope="module")
def ids(smollm2):
    _, tok = smollm2
    return torch.tensor([tok.encode(PROMPT)])


def tiny_model(seed=0, **overrides) -> LlamaModel:
    """A random 2-layer model: fast enough for exhaustive checks."""
    return tiny_llama(seed, **overrides)


# -- KV cache ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_cache_decode_equals_full_forward(smollm2, ids):
    model, _ = smollm2
    with torch.inference_mode():
        full = model(ids).logits
        cache = model.new_cache(max_len=ids.shape[1])
        prefix = 9
        pieces = [model(ids[:, :prefix], cache=cache).logits]
        for t in range(prefix, ids.shape[1]):
            pieces.append(model(ids[:, t : t + 1], cache=cache).logits)
    stepwise = torch.cat(pieces, dim=1)
    assert cache.length == ids.shape[1]
    # same math in another order (one query at a time vs all at once): float32 rounding only;
    # logits are O(10), 1e-3 absolute is ~1e-4 relative
    torch.testing.assert_close(stepwise, full, atol=1e-3, rtol=1e-4)
    assert torch.equal(stepwise.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_cache_chunks_equal_full_forward_tiny(attention):
    """Chunks of several tokens after a prefix need a bottom-right causal mask (sdpa's own is top-left)."""
    model = tiny_model().set_attention(attention)
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    full = model(ids).logits
    cache = KVCache.for_model(model, batch_size=2, max_len=30)
    chunks = [model(ids[:, a:b], cache=cache).logits for a, b in [(0, 5), (5, 6), (6, 15), (15, 23)]]
    # float32, values O(1): differences are rounding only
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=1e-5)


def test_cache_bookkeeping():
    cache = KVCache(2, 1, 3, 8, 4)
    k = torch.randn(1, 3, 5, 4)
    ka, va = cache.append(0, k, k + 1)
    assert ka.shape == (1, 3, 5, 4) and cache.length == 0  # layer 1 has not been written yet
    cache.append(1, k, k)
    assert cache.length == 5 and len(cache) == 5
    ka, _ = cache.append(0, k[:, :, :2], k[:, :, :2])
    assert ka.shape[2] == 7 and torch.equal(ka[:, :, 5:], k[:, :, :2])
    with pytest.raises(ValueError, match="max_len=8"):
        cache.append(0, k, k)
    cache.crop(3)
    assert cache.length == 3 and cache.get(0)[0].shape[2] == 3
    assert cache.nbytes == 2 * 2 * 3 * 8 * 4 * 4
    with pytest.raises(ValueError, match="length must be in 0..3"):
        cache.crop(4)
    with pytest.raises(ValueError, match="batch=1, kv_heads=3"):
        cache.append(0, torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        KVCache(2, 1, 3, 0, 4)


def test_position_must_match_cache():
    model = tiny_model()
    cache = model.new_cache(max_len=8)
    model(torch.tensor([[1, 2, 3]]), cache=cache)
    with pytest.raises(ValueError, match=r"position \(0\) must equal cache.length \(3\)"):
        model(torch.tensor([[4]]), cache=cache, position=0)


# -- attention backends -------------------------------------------------------------------------

@pytest.mark.slow
def test_backends_agree_on_real_model(smollm2, ids):
    model, _ = smollm2
    naive = load_model(attention="naive")
    assert naive is not model and naive.embed_tokens.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    with torch.inference_mode():
        a, b = model(ids).logits, naive(ids).logits
    # the naive backend computes the softmax in float32 too; only summation order differs
    torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("tq,tk,causal", [(7, 7, True), (1, 9, True), (4, 9, True), (5, 5, False), (3, 8, False)])
def test_sdpa_backend_equals_reference(tq, tk, causal):
    g = torch.Generator().manual_seed(tq * 10 + tk)
    q = torch.randn(2, 6, tq, 16, generator=g)
    k, v = torch.randn(2, 3, tk, 16, generator=g), torch.randn(2, 3, tk, 16, generator=g)
    torch.testing.assert_close(sdpa_attention(q, k, v, causal=causal), reference_attention(q, k, v, causal=causal),
                               atol=1e-5, rtol=1e-5)


def test_sdpa_cannot_return_weights():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="use 'naive'"):
        sdpa_attention(q, q, q, causal=True, return_weights=True)


def test_register_backend_is_used():
    calls = []

    def counting(q, k, v, *, causal=False, scale=None, return_weights=False):
        calls.append(q.shape)
        return reference_attention(q, k, v, causal=causal, scale=scale, return_weights=return_weights)

    register_attention_backend("counting-test", counting, replace=True)
    assert "counting-test" in attention_backends()
    model = tiny_model().set_attention("counting-test")
    reference = tiny_model().set_attention("naive")(torch.tensor([[1, 2, 3]])).logits
    torch.testing.assert_close(model(torch.tensor([[1, 2, 3]])).logits, reference)
    assert len(calls) == 2  # one call per layer
    with pytest.raises(ValueError, match="already registered"):
        register_attention_backend("counting-test", lambda *a, **k: None)
    with pytest.raises(ValueError, match="attention must be one of"):
        model.set_attention("no-such-backend")


# -- RoPE layout ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_rope_layout_choice(smollm2, ids):
    """llmu un-permutes the GGUF Q/K rows and rotates halves. Keeping llama.cpp's rows and rotating
    interleaved pairs is the same model; keeping its rows with halves is a different (wrong) one."""
    model, _ = smollm2
    interleaved = build_from_gguf(rope_layout="interleaved")
    wrong = build_from_gguf(rope_layout="interleaved")
    wrong.config.rope_layout = "half"
    for layer in wrong.layers:
        layer.self_attn.rope_layout = "half"
    with torch.inference_mode():
        ref = model(ids).logits
        same = interleaved(ids).logits
        bad = wrong(ids).logits
    # a permutation of the head channels: only the summation order in q.k changes
    torch.testing.assert_close(same, ref, atol=1e-3, rtol=1e-4)
    assert (bad - ref).abs().max() > 1.0  # the logits move by whole units, not by rounding
    assert (bad.argmax(-1) != ref.argmax(-1)).any()


def test_unpermute_inverts_permute():
    w = torch.randn(9 * 64, 5)
    assert torch.equal(unpermute_rope_rows(permute_rope_rows(w, 9), 9), w)
    # inside a head, HF rows 0..31 (first half) land on the even rows of llama.cpp's order
    head = permute_rope_rows(torch.arange(64.0)[:, None], 1)[:, 0]
    assert head[:4].tolist() == [0, 32, 1, 33]


# -- outputs -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_hidden_states_and_attentions(smollm2, ids):
    model, _ = smollm2
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True, output_attentions=True)
    t = ids.shape[1]
    assert out.logits.shape == (1, t, 49152)
    assert len(out.hidden_states) == 31 and all(h.shape == (1, t, 576) for h in out.hidden_states)
    torch.testing.assert_close(out.hidden_states[0], model.embed_tokens.weight[ids])
    assert len(out.attentions) == 30 and out.attentions[0].shape == (1, 9, t, t)
    probs = out.attentions[5]
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 9, t))  # rows are distributions
    assert probs.triu(1).abs().max() == 0  # causal: nothing above the diagonal
    assert model.attention == "sdpa"  # output_attentions borrowed "naive" for one call only


@pytest.mark.slow
def test_last_only(smollm2, ids):
    model, _ = smollm2
    with torch.inference_mode():
        full = model(ids).logits
        last = model(ids, last_only=True).logits
    assert last.shape == (1, 1, 49152)
    torch.testing.assert_close(last[:, 0], full[:, -1], atol=1e-4, rtol=1e-5)


def test_forward_input_checks():
    model = tiny_model()
    with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq\)"):
        model(torch.zeros(1, 1, 3, dtype=torch.long))
    assert model([1, 2, 3]).logits.shape == (1, 3, 97)  # a list is one sequence


@pytest.mark.slow
def test_tied_embeddings(smollm2):
    model, _ = smollm2
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.num_parameters() == model.config.num_parameters() == 134_515_008


def test_replace_linears():
    model = tiny_model()
    x = torch.tensor([[3, 1, 4, 1, 5]])
    ref = model(x).logits

    class Doubled(torch.nn.Module):  # a stand-in "weight format": half the weight, doubled output
        def __init__(self, lin):
            super().__init__()
            self.in_features, self.out_features = lin.in_features, lin.out_features
            self.half = lin.weight / 2

        def forward(self, x):
            return 2 * (x @ self.half.T)

    names = []
    model.replace_linears(lambda name, lin: names.append(name) or Doubled(lin))
    assert "layers.0.self_attn.q_proj" in names and "lm_head" in names and len(names) == 2 * 7 + 1
    torch.testing.assert_close(model(x).logits, ref, atol=1e-5, rtol=1e-5)


def test_linear_checks_shape():
    with pytest.raises(ValueError, match=r"weight must be \(4, 3\)"):
        Linear(3, 4, weight=torch.zeros(3, 4))


# -- loading --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_load_model_is_cached(smollm2):
    model, _ = smollm2
    assert load_model() is model
    assert load_model(attention="naive") is load_model(attention="naive")
    with pytest.raises(ValueError, match="attention must be one of"):
        load_model(attention="nope")
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        load_model(dtype=torch.int8)


@pytest.mark.slow
def test_weights_are_the_q4_1_values(smollm2):
    """The dense weights are exactly the file's dequantized values (Q/K rows reordered)."""
    from llmu.models.gguf_file import GGUFFile

    model, _ = smollm2
    with GGUFFile() as f:
        down = f.tensor("blk.3.ffn_down.weight").dequantize()
        k = f.tensor("blk.3.attn_k.weight").dequantize()
    assert torch.equal(model.layers[3].mlp.down_proj.weight, down)
    assert torch.equal(model.layers[3].self_attn.k_proj.weight, unpermute_rope_rows(k, 3))


@pytest.mark.slow
def test_bfloat16_model(smollm2, ids):
    model, _ = smollm2
    bf = load_model(dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and bf is not model
    with torch.inference_mode():
        a, b = model(ids, last_only=True).logits, bf(ids, last_only=True).logits.float()
    # bfloat16 keeps 8 bits of mantissa: logits move by a few tenths, the top token stays
    assert (a - b).abs().max() < 2.0
    assert a.argmax(-1).item() == b.argmax(-1).item()


def test_rope_tables_made_in_inference_mode_still_allow_gradients():
    """The first forward pass may come from generation (inference mode); the tables it caches
    must still work in a later pass that trains."""
    model = tiny_model()
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))
    for p in model.parameters():
        p.requires_grad_(True)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert model.layers[0].self_attn.q_proj.weight.grad is not None
