"""The two RoPE layouts of ``llmu.layers.reference.apply_rope``, each against an independent
implementation, the permutation that turns one into the other (on activations and on Q/K weights),
and per-row position tables.

- ``"interleaved"`` is checked against Meta's formulation: pairs ``(x[2i], x[2i+1])`` as complex
  numbers multiplied by ``exp(1j * m * theta_i)`` (``torch.view_as_complex`` / ``torch.polar``);
- ``"half"`` against the Hugging Face formulation ``x * cos + rotate_half(x) * sin`` with the
  half-size tables repeated twice.

Angles are made here (float64, then cos/sin rounded to float32) rather than by ``rope_angles``.
Tolerances, float32: the same products in another association (a complex multiply vs two real
multiply-adds): a few ulps of values O(1), 1e-5. The channel permutation only moves numbers: exact.
"""

from __future__ import annotations

import pytest
import torch

from llmu.layers.reference import apply_rope
from llmu.models.loading import permute_rope_rows, unpermute_rope_rows

F32 = dict(atol=1e-5, rtol=1e-5)
SHAPES = [(1, 1, 1, 2), (2, 3, 7, 8), (1, 9, 13, 64), (3, 2, 5, 6)]   # (B, H, T, D); D = 6: 3 pairs


def angles(positions: torch.Tensor, d: int, base: float = 10000.0) -> torch.Tensor:
    """``positions[..., None] * base ** (-2i / d)`` in float64, one angle per pair."""
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return positions.to(torch.float64)[..., None] * inv_freq


def tables(positions, d, base=10000.0):
    a = angles(positions, d, base)
    return a.cos().float(), a.sin().float()


def rope_complex(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE as Meta's code writes it: channel pairs (2i, 2i+1) as complex numbers."""
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * torch.polar(torch.ones_like(a), a)).flatten(-2).to(x.dtype)


def rope_rotate_half(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Half RoPE as Hugging Face writes it: ``x * cos + rotate_half(x) * sin``, full-width tables."""
    cos, sin = torch.cat([a.cos(), a.cos()], -1), torch.cat([a.sin(), a.sin()], -1)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    rotate_half = torch.cat([-x2, x1], dim=-1)
    return (x.double() * cos + rotate_half.double() * sin).to(x.dtype)


def half_order(d: int) -> torch.Tensor:
    """``perm``: interleaved channel order -> half order (0, 2, 4, ..., 1, 3, 5, ...)."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def x_of(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_interleaved_is_complex_multiplication(shape):
    x = x_of(shape, seed=1)
    pos = torch.arange(shape[2]) + 3
    torch.testing.assert_close(apply_rope(x, *tables(pos, shape[3]), "interleaved"),
                               rope_complex(x, angles(pos, shape[3])), **F32)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_half_is_rotate_half(shape):
    x = x_of(shape, seed=2)
    pos = torch.arange(shape[2]) * 5
    torch.testing.assert_close(apply_rope(x, *tables(pos, shape[3], 1e5), "half"),
                               rope_rotate_half(x, angles(pos, shape[3], 1e5)), **F32)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layouts_differ_by_a_channel_permutation(shape):
    # interleaved RoPE on x == half RoPE on x's channels reordered by perm (then reordered back)
    x = x_of(shape, seed=3)
    d = shape[3]
    cos, sin = tables(torch.arange(shape[2]) + 11, d)
    perm = half_order(d)
    inv = torch.argsort(perm)
    assert inv.tolist()[:4] == [0, d // 2, 1, d // 2 + 1][: min(4, d)]   # (0, D/2, 1, D/2+1, ...)
    interleaved = apply_rope(x, cos, sin, "interleaved")
    half = apply_rope(x[..., perm], cos, sin, "half")
    assert torch.equal(interleaved[..., perm], half)
    # and the other way round: half RoPE on y == interleaved RoPE on y's channels reordered by inv
    y = x_of(shape, seed=4)
    assert torch.equal(apply_rope(y, cos, sin, "half")[..., inv], apply_rope(y[..., inv], cos, sin, "interleaved"))
    if d > 2:  # with one pair the two layouts coincide; with more they really differ
        assert not torch.allclose(apply_rope(x, cos, sin, "half"), interleaved)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_converting_weights_permutes_q_and_k_rows_per_head(heads, kv_heads):
    # A checkpoint laid out for interleaved RoPE, its rows permuted inside every head, runs with half
    # RoPE and gives the same attention scores (q . k); permuting back restores the original rows.
    d, dm, t = 8, 20, 6
    g = torch.Generator().manual_seed(5)
    w_q, w_k = torch.randn(heads * d, dm, generator=g), torch.randn(kv_heads * d, dm, generator=g)
    x = torch.randn(t, dm, generator=g)
    cos, sin = tables(torch.arange(t), d)

    def scores(wq, wk, layout):
        q = apply_rope((x @ wq.T).view(t, heads, d).transpose(0, 1), cos, sin, layout)      # (H, T, D)
        k = apply_rope((x @ wk.T).view(t, kv_heads, d).transpose(0, 1), cos, sin, layout)   # (Hkv, T, D)
        return q @ k.repeat_interleave(heads // kv_heads, 0).transpose(-1, -2)

    w_q_half, w_k_half = unpermute_rope_rows(w_q, heads), unpermute_rope_rows(w_k, kv_heads)
    # inside each head, the rows are reordered by perm: (0, 2, 4, ..., 1, 3, ...)
    assert torch.equal(w_q_half.view(heads, d, dm), w_q.view(heads, d, dm)[:, half_order(d)])
    torch.testing.assert_close(scores(w_q_half, w_k_half, "half"), scores(w_q, w_k, "interleaved"), **F32)
    assert torch.equal(permute_rope_rows(w_q_half, heads), w_q)
    assert torch.equal(permute_rope_rows(w_k_half, kv_heads), w_k)
    wrong_layout = scores(w_q, w_k, "half")
    assert not torch.allclose(wrong_layout, scores(w_q, w_k, "interleaved")), "the wrong layout changes the scores"


# -- per-row tables --------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_per_row_tables(layout):
    # cos/sin (B, 1, T, D/2): row b rotated at its own positions, the same for all its heads
    b, h, t, d = 3, 4, 5, 16
    x = x_of((b, h, t, d), seed=6)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [0, 0, 0, 1, 2]])   # the last: left padding
    cos, sin = tables(pos, d)                                                   # (B, T, D/2)
    got = apply_rope(x, cos[:, None], sin[:, None], layout)
    independent = rope_complex if layout == "interleaved" else rope_rotate_half
    for i in range(b):
        torch.testing.assert_close(got[i], apply_rope(x[i], *tables(pos[i], d), layout), **F32)
        torch.testing.assert_close(got[i], independent(x[i], angles(pos[i], d)), **F32)
    # a table with a head axis of its own, (B, H, T, D/2), is used as it is
    cos_h, sin_h = cos[:, None].expand(b, h, t, d // 2), sin[:, None].expand(b, h, t, d // 2)
    assert torch.equal(apply_rope(x, cos_h, sin_h, layout), got)


BAD_TABLES = {
    "(B, T, D/2) for 4-D x": ((3, 5, 8), "cos and sin must have shape"),   # B would line up with H
    "T mismatch": ((3, 1, 4, 8), "cos and sin must have shape"),
    "D/2 mismatch": ((5, 4), "cos and sin must have shape"),
    "batch mismatch": ((2, 1, 5, 8), "cos and sin must have shape"),
}


@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_bad_tables(case):
    shape, match = BAD_TABLES[case]
    x = x_of((3, 4, 5, 16))
    with pytest.raises(ValueError, match=match):
        apply_rope(x, torch.ones(shape), torch.zeros(shape))


def test_cos_and_sin_must_agree():
    x = x_of((3, 4, 5, 16))
    cos, sin = tables(torch.arange(5), 16)
    with pytest.raises(ValueError, match="cos and sin must have shape"):
        apply_rope(x, cos[None, None].expand(3, 1, 5, 8), sin)
