"""Attention backends: named functions the decoder calls for ``softmax(q k^T * scale + mask) v``.

Every backend has the signature of :func:`llmu.attention.reference.attention`::

    fn(q, k, v, *, causal=False, mask=None, scale=None, return_weights=False)

with ``q`` of shape ``(B, H, Tq, D)``, ``k`` of shape ``(B, Hkv, Tk, D)`` and ``v`` of shape
``(B, Hkv, Tk, Dv)`` (``H`` a multiple of ``Hkv``: grouped-query attention; ``Dv`` usually ``D``),
and returns ``(B, H, Tq, Dv)``. ``causal``: the queries are the *last* ``Tq`` of the ``Tk``
positions (the decoding-with-a-cache convention). ``mask``: bool, True = may attend, broadcastable
to ``(B, H, Tq, Tk)``, ANDed with the causal mask; a query row with no visible key gives zeros.
A backend that cannot do some of this (a mask, ``Dv != D``, the weights) raises a ``ValueError``
that names a backend that can; it never ignores an argument. Two are built in:

- ``"naive"``: llmu's reference; materialises the ``(Tq, Tk)`` score matrix and can return it;
- ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``, PyTorch's fused kernels.

Later modules register theirs (``"flash"``) with :func:`register_attention_backend` and switch a
model to them with ``model.set_attention("flash")``. The model passes ``mask=`` only when it has
one, so a backend written for causal attention alone (without a ``mask`` parameter) still serves
the default path. Paged attention (module 09) is not a backend: it needs to know which sequence
each packed token belongs to, so the paged batch passed as the model's ``cache`` does it
(``llmu.paged.PagedBatch.attend``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmu.attention.reference import allowed_keys, attention as naive_attention, causal_mask, check_attention_mask


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    fn: Callable
    returns_weights: bool = False  # True when fn(..., return_weights=True) gives (out, probs)
    description: str = ""


_BACKENDS: dict[str, AttentionBackend] = {}


def register_attention_backend(name: str, fn: Callable, *, returns_weights: bool = False,
                               description: str = "", replace: bool = False) -> AttentionBackend:
    """Make ``fn`` available to ``model.set_attention(name)`` / ``load_model(attention=name)``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if name in _BACKENDS and not replace and _BACKENDS[name].fn is not fn:
        raise ValueError(f"an attention backend named {name!r} is already registered (pass replace=True)")
    backend = AttentionBackend(name, fn, returns_weights, description)
    _BACKENDS[name] = backend
    return backend


def get_attention_backend(name: str) -> AttentionBackend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"attention must be one of {sorted(_BACKENDS)}, got {name!r}") from None


def attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def sdpa_attention(q, k, v, *, causal: bool = False, mask: torch.Tensor | None = None,
                   scale: float | None = None, return_weights: bool = False):
    """Attention through ``torch.nn.functional.scaled_dot_product_attention`` (fused, no weights).

    torch's ``is_causal`` aligns the mask to the top-left corner, which is right only when
    ``Tq == Tk``. With a cache the queries are the last ``Tq`` positions: one query (decoding) sees
    every key and needs no mask; several (a chunk after a prefix) get an explicit bottom-right mask.
    A ``mask`` goes to torch as its boolean ``attn_mask`` (same convention: True = attend), ANDed
    with that causal mask; rows it leaves without any key are set to zero explicitly, so every
    torch kernel keeps the reference's rule.
    """
    if return_weights:
        raise ValueError("the 'sdpa' attention backend cannot return attention weights; use 'naive'")
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if mask is not None:
        return _sdpa_masked(q, k, v, causal=causal, mask=mask, scale=scale)
    if tq == 1 and h != hkv:
        # decoding with GQA: the n_rep query heads of a group read the same keys and values, so
        # they can go through as n_rep "positions" of one KV head (no mask: one query sees all)
        out = F.scaled_dot_product_attention(q.reshape(b, hkv, h // hkv, d), k, v, scale=scale)
        return out.reshape(b, h, 1, v.shape[-1])
    attn_mask, is_causal = None, False
    if causal and tq > 1:
        if tq == tk:
            is_causal = True
        else:
            attn_mask = causal_mask(tq, tk, device=q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=h != hkv
    )


def _sdpa_masked(q, k, v, *, causal: bool, mask: torch.Tensor, scale: float | None):
    """:func:`sdpa_attention` with a boolean ``mask`` (checked, combined with ``causal``)."""
    b, h, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in batch, heads and length (only head_dim may differ), got "
                         f"k {tuple(k.shape)} and v {tuple(v.shape)}")
    mask = allowed_keys(check_attention_mask(mask, (b, h, tq, tk), q.device), causal, tq, tk, q.device)
    if mask.ndim < 2:
        mask = mask[(None,) * (2 - mask.ndim)]   # torch wants at least (Tq, Tk): a (Tk,) mask becomes (1, Tk)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != hkv)
    # a query that sees no key attends to nothing: zeros (not NaN, whatever kernel torch picked)
    return out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)


register_attention_backend("naive", naive_attention, returns_weights=True,
                           description="llmu reference: full score matrix, float32 softmax")
register_attention_backend("sdpa", sdpa_attention, description="torch scaled_dot_product_attention")

