"""Torch references for the parts of a Llama block: RMSNorm, rotary embeddings, SwiGLU.

These are the definitions the Triton kernels in ``kernels.py`` are tested against, and the parts
``llmu.models`` builds its decoder from. They compute in float32 and return the input's dtype.

Rotary embeddings (RoPE) and their two layouts
----------------------------------------------
RoPE cuts a head vector of ``D`` channels into ``D/2`` pairs and turns pair ``i`` of the token at
position ``m`` by the angle ``m * theta_i`` (``theta_i = base ** (-2i / D)``). Which two channels
form pair ``i`` is the *layout*, and checkpoints disagree on it:

- ``"half"``: channels ``(i, i + D/2)``. The vector is rotated as ``x * cos + rotate_half(x) *
  sin`` with ``rotate_half(x) = (-x[D/2:], x[:D/2])``. Hugging Face's Llama, GPT-NeoX, and every
  model llmu loads once converted;
- ``"interleaved"``: channels ``(2i, 2i + 1)``. Pair ``i`` is the complex number
  ``x[2i] + 1j * x[2i+1]``, multiplied by ``exp(1j * m * theta_i)``. The original RoFormer, Meta's
  Llama code (``torch.view_as_complex``), and the Q/K rows stored in a GGUF file.

They are one rotation applied to differently ordered channels: if ``perm = (0, 2, 4, ..., D-2,
1, 3, ..., D-1)`` then ``rope_interleaved(x)[..., perm] == rope_half(x[..., perm])``, and
``perm``'s inverse ``(0, D/2, 1, D/2+1, ...)`` goes back. The channels of ``q`` are rows of
``q_proj``'s weight, head by head, so converting a checkpoint from one layout to the other
permutes the rows of ``q_proj`` and ``k_proj`` inside every head by ``perm`` (interleaved ->
half: Hugging Face's conversion of Meta's weights, ``llmu.models.loading.unpermute_rope_rows``)
or its inverse (half -> interleaved: ``permute_rope_rows``, what llama.cpp's converter does).
Scores ``q . k`` do not change (both sides are permuted alike), nor do ``v_proj``, ``o_proj``.
A checkpoint used with the wrong layout still runs, and gives wrong logits.
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
    """Rotate the pairs of ``x`` (``(..., T, head_dim)``) by the angles behind ``cos`` and ``sin``.

    ``cos`` and ``sin`` (one shape) hold one angle per pair and position:

    - ``(T, head_dim/2)``: every sequence (and head) at the same positions, as :func:`rope_angles`
      makes them;
    - a table with as many dimensions as ``x`` that broadcasts to ``(..., T, head_dim/2)``, such as
      ``(B, 1, T, head_dim/2)`` for ``x`` ``(B, H, T, head_dim)``: each sequence at its own positions
      (a left-padded batch, several sequences decoded together), shared by its heads.

    ``layout`` says which dimensions form a pair (see the module docstring):

    - ``"half"`` (Hugging Face / GPT-NeoX): dimension ``i`` pairs with ``i + head_dim/2``;
    - ``"interleaved"`` (the original RoFormer and llama.cpp): dimension ``2i`` pairs with ``2i+1``.

    The two are the same rotation applied to differently ordered channels, so a checkpoint only
    works with the layout its Q/K weights were laid out for.
    """
    d = x.shape[-1]
    if cos.shape != (x.shape[-2], d // 2) or sin.shape != cos.shape:
        _check_rope_tables(x, cos, sin)
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


def _check_rope_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise unless ``cos``/``sin`` are ``(T, D/2)`` or a same-rank table broadcasting to ``x``'s pairs."""
    if x.ndim < 2:
        raise ValueError(f"x must be (..., T, head_dim), got shape {tuple(x.shape)}")
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"head_dim must be even (dimensions are rotated in pairs), got {d}")
    pairs = (*x.shape[:-1], d // 2)
    ok = cos.shape == sin.shape and (
        tuple(cos.shape) == pairs[-2:]
        or (cos.ndim == x.ndim and all(c in (1, p) for c, p in zip(cos.shape, pairs)) and cos.shape[-1] == d // 2
            and cos.shape[-2] == pairs[-2])
    )
    if not ok:
        raise ValueError(
            f"cos and sin must have shape (T, head_dim/2) = {pairs[-2:]}, or x's rank with sizes that "
            f"broadcast to {pairs} (e.g. (B, 1, T, head_dim/2)); got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation of SwiGLU: ``silu(gate) * up``, computed in float32 at least (half
    precision is widened and rounded back; float64 stays float64, for gradient checks)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    wide = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(wide)) * up.to(wide)).to(gate.dtype)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The Llama feed-forward: ``(silu(x W_gate^T) * (x W_up^T)) W_down^T``.

    Weights follow ``nn.Linear``'s layout: ``w_gate``, ``w_up`` are ``(ffn, d_model)``, ``w_down`` is
    ``(d_model, ffn)``.
    """
    return silu_mul(x @ w_gate.T, x @ w_up.T) @ w_down.T
