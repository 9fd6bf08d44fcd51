"""Rotary position embeddings (RoPE) as a Triton kernel that rotates q and k in place.

RoPE splits each head vector into ``head_dim / 2`` pairs ``(x1, x2)`` and turns pair ``i`` of the
token at position ``m`` by the angle ``m * theta_i``:

.. math::

    \\begin{pmatrix} x_1' \\\\ x_2' \\end{pmatrix} =
    \\begin{pmatrix} \\cos m\\theta_i & -\\sin m\\theta_i \\\\ \\sin m\\theta_i & \\cos m\\theta_i \\end{pmatrix}
    \\begin{pmatrix} x_1 \\\\ x_2 \\end{pmatrix}.

Which two channels form a pair is the *layout*: ``"half"`` pairs channel ``i`` with
``i + head_dim/2`` (Hugging Face, GPT-NeoX), ``"interleaved"`` pairs ``2i`` with ``2i+1``
(RoFormer, Meta's original Llama code, llama.cpp).

A rotation is orthogonal (its transpose is its inverse), so the backward pass of ``y = R(m theta) x``
is ``dx = R(m theta)^T dy = R(-m theta) dy``: the rotation by the opposite angle. The same kernel
does both, with the sign of ``sin`` flipped.

The op reads and writes each element of q and k exactly once, and nothing else is large
(``cos``/``sin`` are ``(T, head_dim/2)``), so it is memory-bound; doing it **in place** avoids
allocating a second copy of q and k. :func:`rope` therefore overwrites its inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmu.checks import FLOAT_DTYPES, require_same_device, require_same_dtype, require_tensor

LAYOUTS = ("half", "interleaved")


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_cb, stride_ct, stride_sb, stride_st,
    T, HQ, HK, HALF,
    HAS_K: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # Step 1: one program per (batch, position); it rotates every q head and every k head there.
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    # Step 2: the angles of this position, one per pair (fp32, whatever dtype cos/sin are stored in).
    cos = tl.load(COS + b * stride_cb + t * stride_ct + i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(SIN + b * stride_sb + t * stride_st + i, mask=i_ok, other=0.0).to(tl.float32)
    if BACKWARD:
        sin = -sin  # rotate by -angle: the transpose of the forward rotation
    # Step 3: where the two members of pair i live inside a head vector.
    if INTERLEAVED:
        off1 = 2 * i
        off2 = 2 * i + 1
    else:
        off1 = i
        off2 = i + HALF
    # Step 4: rotate the q heads, writing back where they were read.
    h = tl.arange(0, BLOCK_HQ)
    mask = (h < HQ)[:, None] & i_ok[None, :]
    base = Q + b * stride_qb + t * stride_qt + h[:, None] * stride_qh
    x1 = tl.load(base + off1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + off2[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(base + off1[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(Q.dtype.element_ty), mask=mask)
    tl.store(base + off2[None, :], (x1 * sin[None, :] + x2 * cos[None, :]).to(Q.dtype.element_ty), mask=mask)
    # Step 5: the same for the k heads (fewer of them under GQA), when k was passed.
    if HAS_K:
        h = tl.arange(0, BLOCK_HK)
        mask = (h < HK)[:, None] & i_ok[None, :]
        base = K + b * stride_kb + t * stride_kt + h[:, None] * stride_kh
        x1 = tl.load(base + off1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + off2[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(base + off1[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(K.dtype.element_ty), mask=mask)
        tl.store(base + off2[None, :], (x1 * sin[None, :] + x2 * cos[None, :]).to(K.dtype.element_ty), mask=mask)


def _check(q, k, cos, sin, layout) -> None:
    require_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if k is None:
        k = q[:, :0]  # no k: check q alone
    else:
        require_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("cos", cos, ndim=(2, 3), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("sin", sin, ndim=(2, 3), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_same_dtype(q=q, k=k)
    require_same_device(q=q, k=k, cos=cos, sin=sin)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    (b, _, t, d), (bk, _, tk, dk) = q.shape, k.shape
    if (b, t, d) != (bk, tk, dk):
        raise ValueError(
            f"q and k must agree in batch, sequence length and head_dim (shapes (B, H, T, D)); "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if d % 2:
        raise ValueError(f"head_dim must be even (channels are rotated in pairs), got {d}")
    want = (t, d // 2) if cos.ndim == 2 else (b, t, d // 2)
    if tuple(cos.shape) != want or tuple(sin.shape) != want:
        raise ValueError(
            f"cos and sin must have shape (T, head_dim/2) = {(t, d // 2)} or (B, T, head_dim/2) = {(b, t, d // 2)}; "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    for name, x in (("q", q), ("k", k)):
        if any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
            raise ValueError(f"{name} is an expanded view (a stride of 0) and cannot be written in place; pass a copy")
    if q.numel() and k.numel() and q.data_ptr() == k.data_ptr():
        raise ValueError("q and k start at the same memory: rotating in place would rotate it twice")


def rope_(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
          layout: str = "half", *, backward: bool = False) -> None:
    """Launch the kernel: rotate ``q`` and ``k`` (``k`` may be None) in place, by ``-angle`` when
    ``backward``. No autograd and no version-counter update: :func:`rope` does those."""
    _check(q, k, cos, sin, layout)
    b, hq, t, d = q.shape
    hk = k.shape[1] if k is not None else 0
    if b * t == 0 or (hq == 0 and hk == 0):
        return
    half = d // 2
    cb, ct = (0, cos.stride(0)) if cos.ndim == 2 else (cos.stride(0), cos.stride(1))
    sb, st = (0, sin.stride(0)) if sin.ndim == 2 else (sin.stride(0), sin.stride(1))
    k_arg = k if k is not None else q  # a placeholder pointer, never read: HAS_K is False
    _rope_kernel[(b * t,)](
        q, k_arg, cos, sin,
        q.stride(0), q.stride(1), q.stride(2),
        k_arg.stride(0), k_arg.stride(1), k_arg.stride(2),
        cb, ct, sb, st,
        t, hq, hk, half,
        HAS_K=k is not None, INTERLEAVED=layout == "interleaved", BACKWARD=backward,
        BLOCK_HQ=triton.next_power_of_2(max(hq, 1)), BLOCK_HK=triton.next_power_of_2(max(hk, 1)),
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        num_warps=4 if (hq + hk) * half < 4096 else 8,
    )


class RoPEFunction(torch.autograd.Function):
    """In-place RoPE on one tensor ``x`` (B, H, T, D); the backward rotates the incoming gradient
    by the opposite angle.

    One tensor per Function: autograd cannot track a Function that modifies a *view* in place
    and returns more than one tensor, and q and k are usually views (heads transposed out of a
    projection's output).
    """

    @staticmethod
    def forward(ctx, x, cos, sin, layout):
        rope_(x, None, cos, sin, layout)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        ctx.layout = layout
        return x

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        dx = dy.contiguous().clone()  # the incoming gradient belongs to autograd: rotate a copy
        rope_(dx, None, cos, sin, ctx.layout, backward=True)
        return dx, None, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         layout: str = "half") -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary embeddings to ``q`` and ``k`` **in place**; return ``(q, k)`` (the same tensors).

    - ``q``: ``(B, Hq, T, D)``, ``k``: ``(B, Hk, T, D)`` (``Hk`` may differ, as in GQA), same dtype
      (fp32/fp16/bf16). Any strides with a contiguous last dimension: a ``(B, T, H, D)`` buffer
      can be passed as its ``.transpose(1, 2)`` view and is rotated where it lies.
    - ``cos``, ``sin``: ``(T, D/2)`` (every sequence at the same positions) or ``(B, T, D/2)`` (each
      sequence at its own positions), as made by :func:`llmu.layers.reference.rope_angles`.
    - ``layout``: ``"half"`` or ``"interleaved"`` (see the module docstring).

    In place means the values of ``q`` and ``k`` are overwritten and their version counters move,
    so autograd knows. When either requires grad, each goes through :class:`RoPEFunction` (one
    launch each) and gradients flow back through the rotation (the backward pass rotates the
    gradient by the opposite angle); otherwise one launch rotates both. As with any in-place op,
    ``q``/``k`` cannot be leaves that require grad, and an earlier op that saved them for its own
    backward will complain. Pass ``q.clone()`` to keep the original. ``q`` and ``k`` must not
    overlap in memory (the same tensor passed twice is refused; partial overlaps are not
    detected). Equals :func:`llmu.layers.reference.apply_rope`.
    """
    _check(q, k, cos, sin, layout)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return RoPEFunction.apply(q, cos, sin, layout), RoPEFunction.apply(k, cos, sin, layout)
    rope_(q, k, cos, sin, layout)
    torch.autograd.graph.increment_version([q, k])  # the kernel wrote through raw pointers
    return q, k
