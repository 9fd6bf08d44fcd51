"""Attention backends: named functions the decoder calls for ``softmax(q k^T * scale + mask) v``.

Every backend has the signature of :func:`llmu.attention.reference.attention`::

    fn(q, k, v, *, causal=False, scale=None, return_weights=False)

with ``q`` of shape ``(B, H, Tq, D)``, ``k``/``v`` of shape ``(B, Hkv, Tk, D)`` (``H`` a multiple of
``Hkv``: grouped-query attention) and, for ``causal``, queries that are the *last* ``Tq`` of the
``Tk`` positions (the decoding-with-a-cache convention). Two are built in:

- ``"naive"``: llmu's reference; materialises the ``(Tq, Tk)`` score matrix and can return it;
- ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``, PyTorch's fused kernels.

Later modules register theirs (``"flash"``) with :func:`register_attention_backend` and switch a
model to them with ``model.set_attention("flash")``. Paged attention (module 09) is not a backend:
it needs to know which sequence each packed token belongs to, so the paged batch passed as the
model's ``cache`` does it (``llmu.paged.PagedBatch.attend``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmu.attention.reference import attention as naive_attention
from llmu.attention.reference import causal_mask


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


def sdpa_attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_weights: bool = False):
    """Attention through ``torch.nn.functional.scaled_dot_product_attention`` (fused, no weights).

    torch's ``is_causal`` aligns the mask to the top-left corner, which is right only when
    ``Tq == Tk``. With a cache the queries are the last ``Tq`` positions: one query (decoding) sees
    every key and needs no mask; several (a chunk after a prefix) get an explicit bottom-right mask.
    """
    if return_weights:
        raise ValueError("the 'sdpa' attention backend cannot return attention weights; use 'naive'")
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if tq == 1 and h != hkv:
        # decoding with GQA: the n_rep query heads of a group read the same keys and values, so
        # they can go through as n_rep "positions" of one KV head (no mask: one query sees all)
        out = F.scaled_dot_product_attention(q.reshape(b, hkv, h // hkv, d), k, v, scale=scale)
        return out.reshape(b, h, 1, d)
    mask, is_causal = None, False
    if causal and tq > 1:
        if tq == tk:
            is_causal = True
        else:
            mask = causal_mask(tq, tk, device=q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=h != hkv
    )


register_attention_backend("naive", naive_attention, returns_weights=True,
                           description="llmu reference: full score matrix, float32 softmax")
register_attention_backend("sdpa", sdpa_attention, description="torch scaled_dot_product_attention")

