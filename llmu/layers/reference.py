"""Torch references for the parts of a Llama block: RMSNorm, rotary embeddings, SwiGLU.

These are the definitions the Triton kernels in ``kernels.py`` are tested against, and the parts
``llmu.models`` builds its decoder from. They compute in float32 and return the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.checks import require_positive


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension.

    Unlike LayerNorm there is no mean subtraction and no bias: the vector is only rescaled to unit
    root-mean-square, then each channel is scaled by a learned gain.
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must have shape {tuple(x.shape[-1:])}, got {tuple(weight.shape)}")
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def rope_angles(
    positions: torch.Tensor, head_dim: int, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each of shape ``(len(positions), head_dim // 2)``.

    Pair ``i`` of a head is rotated by ``position * base ** (-2i / head_dim)``: the first pairs spin
    fast (they encode fine position), the last ones slowly (coarse position).
    """
    require_positive("head_dim", head_dim, integer=True)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (dimensions are rotated in pairs), got {head_dim}")
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate the pairs of ``x`` (``(..., T, head_dim)``) by the angles behind ``cos``/``sin`` (``(T, head_dim/2)``).

    ``layout`` says which dimensions form a pair:

    - ``"half"`` (Hugging Face / GPT-NeoX): dimension ``i`` pairs with ``i + head_dim/2``;
    - ``"interleaved"`` (the original RoFormer and llama.cpp): dimension ``2i`` pairs with ``2i+1``.

    The two are the same rotation applied to differently ordered channels, so a checkpoint only
    works with the layout its Q/K weights were laid out for.
    """
    d = x.shape[-1]
    if cos.shape != (x.shape[-2], d // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must have shape {(x.shape[-2], d // 2)}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    xf = x.float()
    if layout == "half":
        x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
        out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    elif layout == "interleaved":
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        raise ValueError(f"layout must be 'half' or 'interleaved', got {layout!r}")
    return out.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation of SwiGLU: ``silu(gate) * up``."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The Llama feed-forward: ``(silu(x W_gate^T) * (x W_up^T)) W_down^T``.

    Weights follow ``nn.Linear``'s layout: ``w_gate``, ``w_up`` are ``(ffn, d_model)``, ``w_down`` is
    ``(d_model, ffn)``.
    """
    return silu_mul(x @ w_gate.T, x @ w_up.T) @ w_down.T
