"""Torch references for attention and for softmax with temperature.

Shapes follow the course's convention: ``q`` is ``(batch, n_heads, q_len, head_dim)`` and ``k``,
``v`` are ``(batch, n_kv_heads, kv_len, head_dim)``. With fewer KV heads than query heads
(grouped-query attention) each KV head serves ``n_heads // n_kv_heads`` consecutive query heads.
"""

from __future__ import annotations

import math

import torch


def softmax(x: torch.Tensor, dim: int = -1, temperature: float = 1.0) -> torch.Tensor:
    """Numerically stable ``softmax(x / temperature)``: the row maximum is subtracted before exp."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {temperature!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    z = x.float() / temperature
    z = z - z.amax(dim=dim, keepdim=True)
    e = z.exp()
    return (e / e.sum(dim=dim, keepdim=True)).to(x.dtype)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``(B, Hkv, T, D)`` → ``(B, Hkv * n_rep, T, D)``, each KV head repeated for its query group."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def causal_mask(q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """Boolean ``(q_len, kv_len)`` mask, True where a query may attend.

    Queries are the *last* ``q_len`` positions of the ``kv_len`` keys (as in decoding with a cache):
    query ``i`` sits at position ``kv_len - q_len + i`` and sees keys ``0 .. that position``.
    """
    if q_len > kv_len:
        raise ValueError(f"a causal mask needs q_len <= kv_len, got q_len={q_len}, kv_len={kv_len}")
    offset = kv_len - q_len
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return j <= i + offset


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_weights: bool = False,
):
    """Naive scaled dot-product attention, materialising the full score matrix.

    ``softmax(q k^T * scale + mask) v`` with ``scale = 1/sqrt(head_dim)`` by default. Computed in
    float32; the output has ``q``'s dtype. With ``return_weights`` also returns the
    ``(B, H, q_len, kv_len)`` attention probabilities.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be 4-D (batch, heads, seq, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, tq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k must be (batch={b}, kv_heads, kv_len, head_dim={d}), got {tuple(k.shape)}")
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"the number of query heads ({h}) must be a multiple of the KV heads ({hkv})")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kf = repeat_kv(k.float(), h // hkv)
    vf = repeat_kv(v.float(), h // hkv)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(tq, k.shape[2], device=q.device), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = (p @ vf).to(q.dtype)
    return (out, p) if return_weights else out
