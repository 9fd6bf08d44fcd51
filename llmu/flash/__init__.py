"""Module 08: FlashAttention — attention without the N×N score matrix.

- ``llmu.flash.reference``: the tiled algorithm in PyTorch, written to be read (online softmax,
  ``flash_attention`` returning ``(out, lse)``, the backward formulas, memory-traffic counts);
- ``llmu.flash.kernels``: FlashAttention-2 in Triton, forward and backward (``flash_attention``,
  an ``autograd.Function`` that saves ``(q, k, v, o, lse)``);
- ``llmu.flash.bench``: the benchmark entries (forward and forward+backward TFLOP/s).

Importing ``llmu.flash`` registers the Triton kernel as the model's attention backend ``"flash"``
and the torch tiled reference as ``"flash_torch"``::

    import llmu.flash
    model.set_attention("flash")          # or load_model(attention="flash")

The notebook is ``solutions/08_flash_attention/08_flash_attention.ipynb``.
"""

from __future__ import annotations

from llmu.flash import reference
from llmu.flash.kernels import HEAD_DIMS, FlashAttentionFunction, flash_attention
from llmu.models.backends import register_attention_backend

__all__ = ["flash_attention", "FlashAttentionFunction", "HEAD_DIMS", "flash_backend", "flash_torch_backend", "reference"]


def _refuse_general(name: str, v, q, mask) -> None:
    """The FlashAttention kernels here do causal or full attention with one head size: refuse the rest."""
    if mask is not None:
        raise ValueError(f"the {name!r} attention backend does not take a mask (it knows only causal=); "
                         "use the 'naive' or 'sdpa' backend for a boolean mask")
    if getattr(v, "ndim", 0) == 4 and getattr(q, "ndim", 0) == 4 and v.shape[-1] != q.shape[-1]:
        raise ValueError(f"the {name!r} attention backend needs v's head_dim equal to q's and k's, got "
                         f"{v.shape[-1]} and {q.shape[-1]}; use the 'naive' or 'sdpa' backend for d_v != d_k")


def flash_backend(q, k, v, *, causal: bool = False, mask=None, scale: float | None = None,
                  return_weights: bool = False):
    """The attention-backend signature around :func:`llmu.flash.kernels.flash_attention`.

    No ``mask`` and no ``d_v != d_k``: both are refused with a ``ValueError``."""
    if return_weights:
        raise ValueError("the 'flash' attention backend never forms the attention weights; use 'naive' to see them")
    _refuse_general("flash", v, q, mask)
    return flash_attention(q, k, v, causal=causal, scale=scale)


def flash_torch_backend(q, k, v, *, causal: bool = False, mask=None, scale: float | None = None,
                        return_weights: bool = False):
    """The attention-backend signature around the torch tiled reference (forward only).

    No ``mask`` and no ``d_v != d_k``: both are refused with a ``ValueError``."""
    if return_weights:
        raise ValueError("the 'flash_torch' attention backend never forms the attention weights; use 'naive'")
    _refuse_general("flash_torch", v, q, mask)
    return reference.flash_attention(q, k, v, causal=causal, scale=scale)[0]


register_attention_backend("flash", flash_backend, description="llmu FlashAttention-2 Triton kernel")
register_attention_backend("flash_torch", flash_torch_backend, description="llmu tiled FlashAttention in torch")
