"""Torch references for attention and for softmax with temperature.

Shapes follow the course's convention: ``q`` is ``(batch, n_heads, q_len, head_dim)`` and ``k``,
``v`` are ``(batch, n_kv_heads, kv_len, head_dim)``. With fewer KV heads than query heads
(grouped-query attention) each KV head serves ``n_heads // n_kv_heads`` consecutive query heads.

Which keys a query may see is said by a boolean mask, True = attend (PyTorch's convention for a
boolean ``attn_mask``): ``causal=True`` builds the causal one, ``mask=`` takes any other (padding,
a document boundary, a sliding window), broadcast over the batch and the heads; both may be given.
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


def check_attention_mask(mask, shape: tuple[int, int, int, int], device=None) -> torch.Tensor:
    """Check a boolean attention ``mask`` against the scores' shape ``(B, H, Tq, Tk)``; return it.

    ``mask`` is True where a query may attend to a key. It may have any shape that broadcasts to
    ``(B, H, Tq, Tk)`` without being made larger: ``(Tq, Tk)`` for one pattern shared by the
    whole batch, ``(B, 1, Tq, Tk)`` for one per sequence, shared by its heads (a padding mask),
    ``(B, 1, 1, Tk)`` for one set of visible keys per sequence, ``(B, H, Tq, Tk)`` for everything.
    Broadcasting lines the shapes up from the right, as torch does. The mask is returned as it
    came (not expanded: broadcasting costs nothing).
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a bool torch.Tensor (True = attend), got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must have dtype torch.bool (True = attend), got {mask.dtype}; an additive float "
                        "mask is not accepted: for one of 0 (attend) and -inf (do not), pass `mask == 0`")
    if mask.ndim > 4:
        raise ValueError(f"mask must have at most 4 dimensions (B, H, Tq, Tk), got shape {tuple(mask.shape)}")
    shape = tuple(shape)
    try:
        broadcast = torch.broadcast_shapes(tuple(mask.shape), shape)
    except RuntimeError:
        broadcast = None
    if broadcast != shape:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
                         f"(B, H, Tq, Tk) = {shape}; use e.g. (Tq, Tk), (B, 1, Tq, Tk) or (B, H, Tq, Tk)")
    if device is not None and mask.device != torch.device(device):
        raise ValueError(f"mask must be on q's device ({device}), got {mask.device}")
    return mask


def allowed_keys(mask: torch.Tensor | None, causal: bool, q_len: int, kv_len: int, device=None) -> torch.Tensor | None:
    """Which keys each query may see: ``mask`` (already checked) AND, with ``causal``, the
    :func:`causal_mask`; ``None`` when neither restricts anything. Every backend that takes a mask
    combines the two here."""
    if not causal:
        return mask
    causal_part = causal_mask(q_len, kv_len, device=device)
    return causal_part if mask is None else mask & causal_part


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
):
    """Naive scaled dot-product attention, materialising the full score matrix.

    ``softmax(q k^T * scale + mask) v`` with ``scale = 1/sqrt(head_dim)`` by default:

    - ``q`` ``(B, H, Tq, D)``, ``k`` ``(B, Hkv, Tk, D)``, ``v`` ``(B, Hkv, Tk, Dv)``: ``H`` a multiple
      of ``Hkv`` (grouped-query attention); ``v``'s head size may differ from ``q``/``k``'s (the
      output has ``Dv`` channels, as in MLA), but ``k`` and ``v`` agree on batch, heads and length.
    - ``causal``: query ``i`` sees keys up to its own position, the queries being the *last* ``Tq``
      of the ``Tk`` positions (see :func:`causal_mask`).
    - ``mask``: bool, True = may attend, any shape that broadcasts to ``(B, H, Tq, Tk)`` (see
      :func:`check_attention_mask`). With ``causal`` too, a key must be allowed by both.

    A query row that may attend to no key at all (every entry of its mask False, a padding query
    in a padded batch) has no softmax: its weights are all zero and its output is zero, as
    FlashAttention and PyTorch's ``scaled_dot_product_attention`` do, rather than ``0/0 = NaN``
    that would poison every later layer (a NaN value times a zero weight is still NaN).

    Computed in float32; the output has ``q``'s dtype. With ``return_weights`` also returns the
    ``(B, H, Tq, Tk)`` attention probabilities (float32).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be 4-D (batch, heads, seq, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in batch, heads and length (only head_dim may differ), got "
                         f"k {tuple(k.shape)} and v {tuple(v.shape)}")
    b, h, tq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k must be (batch={b}, kv_heads, kv_len, head_dim={d}), got {tuple(k.shape)}")
    hkv, tk = k.shape[1], k.shape[2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"the number of query heads ({h}) must be a multiple of the KV heads ({hkv})")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a number or None, got {scale!r}")
    if mask is not None:
        check_attention_mask(mask, (b, h, tq, tk), q.device)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # 1. every query head reads its group's keys and values
    kf = repeat_kv(k.float(), h // hkv)
    vf = repeat_kv(v.float(), h // hkv)
    # 2. all the scores at once: (B, H, Tq, Tk)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    # 3. what a query may not see gets -inf, so exp() gives it weight 0
    allowed = allowed_keys(mask, causal, tq, tk, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if mask is not None:
        # 4. a row with no allowed key is all -inf: softmax gives NaN there; it attends to nothing
        p = p.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
    out = (p @ vf).to(q.dtype)
    return (out, p) if return_weights else out


def grouped_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           hide: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for a few queries per key/value head, in the fewest PyTorch calls: ``q`` ``(Hkv, R, D)``
    holds, for each key/value head, the rows of every query head that shares it (and every token),
    ``k``, ``v`` ``(Hkv, L, D)`` its keys and values; ``hide`` (bool, True = not seen) broadcasts to
    ``(Hkv, R, L)``. Two products and a softmax, no copy of ``k`` or ``v``: what a decode step
    needs, where SDPA's dispatch costs more than its arithmetic (``llmu.models.decode_step``,
    ``llmu.paged.cache.DecodeIndex``). Returns ``(Hkv, R, D)``."""
    scores = torch.bmm(q, k.transpose(1, 2)) * scale                                # (Hkv, R, L)
    if hide is not None:
        scores = scores.masked_fill(hide, float("-inf"))
    return torch.bmm(torch.softmax(scores, -1), v)

