"""Torch references for module 00: the softmax the Triton kernel is checked against.

Vector addition needs no reference beyond ``x + y``. Softmax is written out here step by step, in
the two versions the notebook contrasts: the textbook formula, which overflows, and the stable one
every real implementation uses.
"""

from __future__ import annotations

import torch

__all__ = ["naive_softmax", "stable_softmax"]


def naive_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(x) / sum(exp(x))`` exactly as written: in float32, ``exp(89)`` is already ``inf``."""
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def stable_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax with the maximum subtracted first; computed in float32, returned in ``x``'s dtype.

    ``softmax(x) == softmax(x - c)`` for any constant ``c`` (the factor ``exp(-c)`` cancels between
    numerator and denominator). With ``c = max(x)`` every exponent is at most 0, so ``exp`` stays in
    ``(0, 1]`` and the sum is at least 1: no overflow, and no division by zero.
    """
    xf = x.float()
    z = xf - xf.amax(dim=dim, keepdim=True)
    e = torch.exp(z)
    return (e / e.sum(dim=dim, keepdim=True)).to(x.dtype)
