"""KV-head pooling, MLA (absorbed == unabsorbed), KV bytes per token."""

from __future__ import annotations

import pytest
import torch

from llmu.attention import reference as attn_ref
from llmu.gqa import reference as R
from llmu.layers.reference import apply_rope, rope_angles

# -- pooling ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n_kv, new, d_in, head_dim", [(3, 1, 576, 64), (8, 2, 16, 4), (4, 4, 5, 3), (6, 3, 7, 2)])
def test_pool_shapes_and_values(n_kv, new, d_in, head_dim):
    w = torch.randn(n_kv * head_dim, d_in)
    r = n_kv // new
    for method in ("mean", "first"):
        p = R.pool_kv_heads(w, n_kv, new, method)
        assert p.shape == (new * head_dim, d_in)
        for j in range(new):
            heads = [w[(j * r + i) * head_dim:(j * r + i + 1) * head_dim] for i in range(r)]
            want = torch.stack(heads).mean(0) if method == "mean" else heads[0]
            torch.testing.assert_close(p[j * head_dim:(j + 1) * head_dim], want)  # same float ops: tight


def test_pool_group_one_is_identity_and_a_copy():
    w = torch.randn(3 * 64, 576)
    p = R.pool_kv_heads(w, 3, 3)
    assert torch.equal(p, w) and p.data_ptr() != w.data_ptr()
    b = torch.randn(3 * 64)
    assert torch.equal(R.pool_kv_heads(b, 3, 3, "first"), b)


def test_pooled_keys_commute_with_rope():
    """mean-pool then rotate == rotate then mean-pool: RoPE is the same linear map on every head."""
    hkv, d, d_in, t = 4, 16, 24, 7
    w, x = torch.randn(hkv * d, d_in, dtype=torch.float64), torch.randn(t, d_in, dtype=torch.float64)
    cos, sin = (a.double() for a in rope_angles(torch.arange(t), d, 10000.0))
    keys = apply_rope((x @ w.T).view(t, hkv, d).transpose(0, 1), cos, sin)          # (Hkv, T, D)
    pooled_then_rotated = apply_rope((x @ R.pool_kv_heads(w, hkv, 1).T)[None], cos, sin)[0]
    # exact algebra, but apply_rope computes in float32 (then casts back): float32 tolerances
    torch.testing.assert_close(pooled_then_rotated, keys.mean(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args, match", [
    ((torch.randn(12, 3), 3, 2), "must divide"),
    ((torch.randn(12, 3), 3, 0), "positive"),
    ((torch.randn(10, 3), 3, 1), "multiple of n_kv_heads"),
    ((torch.randn(12, 3, 2), 3, 1), "weight"),
])
def test_pool_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        R.pool_kv_heads(*args)
    with pytest.raises(ValueError, match="method"):
        R.pool_kv_heads(torch.randn(12, 3), 3, 1, "max")
    with pytest.raises(TypeError):
        R.pool_kv_heads([[1.0]], 1, 1)


@pytest.mark.slow
def test_convert_model_shares_weights_and_leaves_original(smollm2):
    model, _ = smollm2
    ids = torch.tensor([[1, 504, 3300, 314, 260, 1345, 28, 2714]])
    before = model(ids).logits
    same = R.convert_kv_heads(model, 3)                       # group 1: the model itself
    torch.testing.assert_close(same(ids).logits, before, rtol=0, atol=0)
    mqa = R.convert_kv_heads(model, 1, method="mean")
    attn = mqa.layers[0].self_attn
    assert attn.k_proj.weight.shape == (64, 576) and attn.num_kv_heads == 1 and mqa.config.num_key_value_heads == 1
    assert mqa.embed_tokens.weight.data_ptr() == model.embed_tokens.weight.data_ptr()   # shared, not copied
    assert model.layers[0].self_attn.num_kv_heads == 3 and model.config.num_key_value_heads == 3
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)                  # original untouched
    assert not torch.allclose(mqa(ids).logits, before)
    part = R.convert_kv_heads(model, 1, layers=[29])
    assert part.layers[29].self_attn.num_kv_heads == 1 and part.layers[0].self_attn.num_kv_heads == 3
    assert part.config.num_key_value_heads == 3
    with pytest.raises(ValueError, match="out of range"):
        R.convert_kv_heads(model, 1, layers=[30])
    with pytest.raises(ValueError, match="must divide"):
        R.convert_kv_heads(model, 2)


# -- MLA --------------------------------------------------------------------------------------

@pytest.mark.parametrize("b, t, h, dh, dc, dr", [(1, 1, 1, 8, 4, 2), (2, 9, 4, 32, 64, 16), (1, 17, 3, 16, 24, 8)])
def test_mla_absorbed_equals_unabsorbed(b, t, h, dh, dc, dr):
    p = R.MLAWeights.random(48, h, dh, dc, dr, seed=t)
    x = torch.randn(b, t, 48, dtype=torch.float64)
    # float64: the two forms only reassociate products, so they agree to ~1e-15 relative
    torch.testing.assert_close(R.mla_absorbed(x, p), R.mla_unabsorbed(x, p), rtol=1e-10, atol=1e-12)


def test_mla_unabsorbed_is_attention_over_concatenated_keys():
    """The unabsorbed form is ordinary causal attention with keys [k_c ; k_r] and queries [q_c ; q_r]."""
    p = R.MLAWeights.random(40, 2, 8, 12, 4)
    x = torch.randn(1, 6, 40, dtype=torch.float64)
    pos = torch.arange(6)
    c, k_r = p.latent(x, pos)
    q_c, q_r = p.queries(x, pos)
    k = torch.cat([(c @ p.w_uk).view(1, 6, 2, 8).transpose(1, 2), k_r[:, None].expand(1, 2, 6, 4)], -1)
    v = (c @ p.w_uv).view(1, 6, 2, 8).transpose(1, 2)
    v_padded = torch.cat([v, torch.zeros(1, 2, 6, 4, dtype=v.dtype)], -1)   # the reference wants k, v alike
    out = attn_ref.attention(torch.cat([q_c, q_r], -1), k, v_padded, causal=True)[..., :8]
    # attn_ref.attention computes its softmax in float32: float32 tolerances
    torch.testing.assert_close(R.mla_unabsorbed(x, p), out.transpose(1, 2).reshape(1, 6, 16) @ p.w_o, rtol=1e-5, atol=1e-5)


def test_mla_decode_with_latent_cache_matches_full_pass():
    p = R.MLAWeights.random(32, 4, 8, 16, 4, seed=3)
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    full = R.mla_unabsorbed(x, p)
    c, k_r = p.latent(x[:, :7], torch.arange(7))
    for t in range(7, 10):
        out, c, k_r = R.mla_decode(x[:, t:t + 1], c, k_r, p)
        torch.testing.assert_close(out, full[:, t:t + 1], rtol=1e-10, atol=1e-12)
    assert c.shape == (2, 10, 16) and k_r.shape == (2, 10, 4)   # the whole cache: d_c + d_r per token


def test_mla_float32_tight():
    p = R.MLAWeights.random(64, 4, 16, 32, 8, dtype=torch.float32, seed=1)
    x = torch.randn(2, 12, 64)
    # float32 reassociation of sums of ~100 products: differences around 1e-6
    torch.testing.assert_close(R.mla_absorbed(x, p), R.mla_unabsorbed(x, p), rtol=1e-4, atol=1e-5)


# -- KV bytes ---------------------------------------------------------------------------------

def test_kv_bytes_deepseek_v2_like_by_hand():
    s = R.DEEPSEEK_V2_LIKE
    assert R.kv_bytes_per_token("MHA", **s) == 2 * 128 * 128 * 60 * 2 == 3_932_160
    assert R.kv_bytes_per_token("GQA", **s) == 2 * 8 * 128 * 60 * 2 == 245_760
    assert R.kv_bytes_per_token("MQA", **s) == 2 * 128 * 60 * 2 == 30_720
    assert R.kv_bytes_per_token("MLA", **s) == (512 + 64) * 60 * 2 == 69_120
    # DeepSeek-V2's own statement: MLA stores (d_c + d_r) = 4.5 d_h values per layer
    assert (512 + 64) / 128 == 4.5


def test_kv_bytes_smollm2():
    # SmolLM2-135M: 30 layers, 9 heads of 64, 3 KV heads; fp32 = 4 bytes
    assert R.kv_bytes_per_token("GQA", layers=30, heads=9, head_dim=64, kv_heads=3, bytes_per_value=4) == 46_080
    assert R.kv_bytes_per_token("GQA", layers=30, heads=9, head_dim=64, kv_heads=9, bytes_per_value=4) == \
        R.kv_bytes_per_token("MHA", layers=30, heads=9, head_dim=64, bytes_per_value=4)


def test_kv_cache_table():
    rows = R.kv_cache_table(context=1000, batch=2)
    assert [r["scheme"] for r in rows] == ["MHA", "GQA", "MQA", "MLA"]
    assert rows[0]["vs_mha"] == 1 and rows[0]["cache_gb"] == pytest.approx(3_932_160 * 2000 / 1e9)
    assert rows[3]["vs_mha"] == pytest.approx(69_120 / 3_932_160)


@pytest.mark.parametrize("scheme, kw, match", [
    ("GQA", dict(kv_heads=None), "kv_heads"), ("GQA", dict(kv_heads=3), "kv_heads"),
    ("MLA", dict(latent_dim=None, rope_dim=64), "latent_dim"), ("XYZ", {}, "scheme"),
    ("MHA", dict(layers=0), "layers"),
])
def test_kv_bytes_bad(scheme, kw, match):
    base = dict(layers=2, heads=4, head_dim=8)
    base.update(kw)
    with pytest.raises(ValueError, match=match):
        R.kv_bytes_per_token(scheme, **base)
