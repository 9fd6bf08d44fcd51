"""Triton kernels of module 13: the selective scan, chunked, with the state kept on chip; and its backward.

``selective_scan_triton(u, delta, A, B, C, D, z, delta_bias, delta_softplus)`` computes what
``llmu.mamba.reference.selective_scan_sequential`` computes (read its module docstring for the
shapes and the math) in one launch. The grid is ``(batch, ceil(D / BLOCK_D))``: each program owns
``BLOCK_D`` channels of one sequence, and therefore their ``BLOCK_D x N`` state. It walks the
sequence in chunks of ``CHUNK`` time steps:

1. load the chunk's ``u``, ``Δ`` (``BLOCK_D x CHUNK``) and ``B``, ``C`` (``N x CHUNK`` per channel);
   apply ``delta_bias`` and softplus to ``Δ`` in registers;
2. discretise: ``Ā = exp(Δ A)``, ``B̄u = Δ B u``, tiles of ``BLOCK_D x N x CHUNK``;
3. scan *inside* the chunk with ``tl.associative_scan`` and the operator
   ``(a, b) ∘ (a', b') = (a a', a' b + b')`` (``reference.combine``): position ``t`` gets the
   product of the ``Ā`` so far, ``P_t``, and the state the chunk alone would have built, ``S_t``;
4. fold in the state carried from the previous chunks, ``h``: ``x_t = P_t h + S_t``;
5. read out ``y_t = Σ_n x_t[n] C_t[n]``, add ``D u``, gate with ``silu(z)``, store ``out``;
6. carry: ``h = x`` at the chunk's last step. Steps past ``L`` are the identity ``(1, 0)``, so the
   last column of a ragged chunk is the state at ``L - 1``.

After the last chunk the program writes ``h`` (the last state) if asked. This is the structure of
the CUDA kernel shipped with Mamba: there a thread block owns one channel (or a few), its threads
split a chunk of up to 2048 time steps, each state index ``n`` is scanned across the threads with a
block-wide scan, and the running prefix is carried from chunk to chunk.

The napkin math
---------------
Per element ``(b, d, t)`` the kernel reads ``u``, ``Δ`` and ``z`` once and writes ``out`` once;
``B`` and ``C`` (``N`` values per time step, shared by all the channels of a group) are read from
HBM once and served to the other channels by the caches. The state ``x`` — ``N`` float32 values
per channel and step — lives in registers and never reaches HBM, except the last one. For a
Mamba-370M-like layer (``D = 2048`` channels, ``N = 16``), ``B = 8``, ``L = 2048``, bf16::

    u, Δ, z, out   4 * B*D*L * 2 bytes   = 268 MB   (56 us at an H200's 4.8 TB/s)
    B, C           2 * B*N*L * 2 bytes   = 1 MB
    arithmetic     per (b, d, t, n): one exp and about 6 flops (Δ·A, the recurrence's
                   multiply-add, the readout's multiply-add) = 3.2 GFLOP and 0.5 G exps

Some 12 flops per byte, near the H200's float32 ridge point (about 67 TFLOP/s of FMA against
4.8 TB/s: 14 flops per byte), and the exps run on the slower special-function units: the fused
scan is about balanced between memory and arithmetic, if anything compute-bound. (This kernel's in-chunk
``tl.associative_scan`` is a tree: it does ``log2(CHUNK)`` combines per element instead of one,
which tips it towards compute; the CUDA kernel scans each thread's items sequentially and uses a
tree only across threads. Its speed on a GPU is not measured yet.) What fusion buys is the
traffic: the torch references materialise ``Ā`` and ``B̄u`` as ``(B, D, L, N)`` float32 tensors,
``4 N = 64`` bytes per element ``(b, d, t)`` each, where the inputs are 2: for the layer above
4.3 GB written and as much read back, 32 times the kernel's 268 MB (and the parallel scan makes
``log2 L`` such passes). That is why Mamba needed a fused kernel to be fast.

The backward
------------
With ``h_t = Ā_t h_{t-1} + B̄u_t`` and ``y_t = Σ_n C_t[n] h_t[n]``, the gradient of the loss with
respect to the state, the *adjoint* ``g_t = ∂loss/∂h_t``, obeys the same kind of recurrence run
backwards in time::

    g_t = C_t dy_t + Ā_{t+1} g_{t+1}          (g after the last step: the last state's gradient, or 0)

(``dy_t = ∂loss/∂y_t``: ``dout_t`` times ``silu(z_t)``.) It is a linear recurrence with the
elements ``(Ā_{t+1}, C_t dy_t)``, so the same operator scans it, with ``reverse=True``. Everything
else follows from ``g`` and the states, per channel ``d``, state index ``n`` and step ``t``::

    Ā_t h_{t-1} = h_t - B̄u_t                           (the state before the step, not stored)
    dC_t[n]  += dy_t h_t[n]                              summed over the channels of C's group
    dB_t[n]  += g_t[n] Δ_t u_t                           summed over the channels of B's group
    du_t      = Δ_t Σ_n g_t[n] B_t[n] + D dy_t
    dΔ_t      = Σ_n g_t[n] (A[n] Ā_t h_{t-1}[n] + u_t B_t[n])
    dA[n]    += Σ_t g_t[n] Δ_t Ā_t h_{t-1}[n]             summed over batch and time
    d(delta)  = dΔ σ(delta + delta_bias)  with softplus  (its derivative; 1 above 20, or without)
    d(delta_bias) = Σ_{b,t} d(delta),  dD = Σ_{b,t} dy u,  dz = dout y σ(z) (1 + z (1 - σ(z)))

The backward kernel has the forward's grid and tiles (with 8 warps, :data:`BWD_NUM_WARPS`) and
walks the chunks from last to first. Per chunk: (1) reload the chunk's inputs and the state the
forward left at the chunk's start (a *checkpoint*); (2) recompute the chunk's states exactly as the
forward did; (3) go through the gate and the skip to get ``dy`` and ``dz``; (4) scan the adjoint
backwards, carrying ``g`` from the chunk after (``Ā_{t+1}`` comes from ``Δ`` reloaded one step
later: Triton has no cheap way to shift a tile by one position in registers); (5) form the
gradients above. ``du``, ``dΔ`` and ``dz`` belong to one program and are stored; ``dA``, ``dD`` and
``d(delta_bias)`` are summed over the chunks in registers and stored once per ``(b, d)``, then
summed over the batch by torch; ``dB`` and ``dC`` of the input-dependent and grouped forms are
shared by the channels of a group (and so by several programs): they are added with float32 atomic
adds into a ``(batch, G, N, L)`` buffer, as Mamba's CUDA backward does (the order of those
additions varies from run to run on a GPU: the last bits of ``dB`` and ``dC`` can too). A
time-invariant ``B`` or ``C`` ``(D, N)`` is summed over time in registers like ``dA``.

What is stored and what is recomputed, for the layer above (``CHUNK = 64``)::

    every state h_t, (B, D, L, N) float32         2.1 GB   (what autograd through a torch scan keeps,
                                                            several times over)
    the checkpoints, (B, D, L / CHUNK, N) float32   34 MB   what the forward stores here: one state per
                                                            chunk, 1/CHUNK of the states, an eighth of
                                                            the 268 MB of inputs and output
    recomputed per chunk in the backward:          Δ, Ā, B̄u, the chunk's states (one scan), y,
                                                   Ā_{t+1} (a second exp per element), the adjoint
                                                   (a second scan)

so the backward costs about twice the forward's arithmetic and reads each input once more, and
saves no ``(B, D, L, N)`` tensor. On top of the inputs it reads ``dout`` and writes ``du``, ``dΔ``,
``dz`` (``4 B*D*L`` elements) and adds ``2 B*D*L*N`` float32 values atomically into ``dB``, ``dC``
(in the GPU's L2 cache; there are only ``2 B*G*N*L`` distinct addresses).

The launcher
------------
Every tensor on the kernel device, floating point (``u``, ``Δ``, ``B``, ``C``, ``z`` float32,
float16 or bfloat16; ``A``, ``D``, ``delta_bias`` any float dtype, read as float32); shapes as
in ``reference.check_scan_inputs`` (the same ``ValueError`` messages). All arithmetic is float32;
``out`` has ``u``'s dtype; the last state is float32 ``(B, D, N)``. Any strides: ``B`` and ``C`` in
all three forms are passed to the kernel as one ``(batch, G, N, L)`` view with strides (a
time-invariant ``(D, N)`` is ``G = D`` groups with stride 0 along batch and time), so nothing is
copied. ``chunk`` and ``block_d`` must be powers of two; by default the launcher keeps a
``BLOCK_D x N x CHUNK`` tile at 2048 elements or fewer. When an input requires grad (and grad mode
is on), the launch goes through :class:`SelectiveScanFunction`, a ``torch.autograd.Function`` (as
Triton's fused-attention tutorial wraps its kernels): the forward also writes the checkpoints, the
backward launches the backward kernel, and each gradient has its input's shape and dtype (the last
state's gradient is used too, when the loss reads it). Double backward is not supported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmu.checks import FLOAT_DTYPES, require_power_of_two, require_tensor
from llmu.mamba import reference

__all__ = ["BWD_NUM_WARPS", "MAX_TILE", "SelectiveScanFunction", "choose_tiles", "selective_scan_triton"]

#: The largest ``BLOCK_D x N_PAD x CHUNK`` tile the default tiles use: with 4 warps on a GPU, 16
#: values per thread for each of ``Ā``, ``B̄u``, ``C`` and the scan's outputs.
MAX_TILE = 2048
#: Warps per program of the backward kernel. It keeps about twice the forward's tiles live (the
#: states, the adjoint, both scans' outputs): with the forward's 4 warps it spills on sm_90 (255
#: registers and some 300 spilled values per thread at the default 2 x 16 x 64 tile, as
#: ``llmu gpu-compile`` reports), with 8 warps it fits in registers.
BWD_NUM_WARPS = 8


@triton.jit
def _combine(a1, b1, a2, b2):
    """``(a1, b1) ∘ (a2, b2) = (a1 a2, a2 b1 + b2)``: apply step 1, then step 2."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _step_size(delta_ptrs, mask, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """``(Δ, x)``: ``x = delta + bias`` and ``Δ = softplus(x)`` (or ``x``) where ``mask`` holds, ``Δ = 0``
    elsewhere (so that a step past ``L`` is the identity). ``bias`` is ``(BLOCK_D,)``."""
    x = tl.load(delta_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x = x + bias[:, None]
    dt = x
    if SOFTPLUS:
        # log(1 + e^x), and x itself above 20 (as torch's softplus: e^-20 is below fp32's resolution)
        dt = tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)
    return tl.where(mask, dt, 0.0), x


@triton.jit
def _selective_scan_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, last_ptr, ckpt_ptr,
    dim, L, N, per_group_B, per_group_C,
    s_ub, s_ud, s_ul,
    s_db, s_dd, s_dl,
    s_ad, s_an,
    s_Bb, s_Bg, s_Bn, s_Bl,
    s_Cb, s_Cg, s_Cn, s_Cl,
    s_D, s_bias,
    s_zb, s_zd, s_zl,
    s_ob, s_od, s_ol,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    STORE_LAST: tl.constexpr, STORE_CHECKPOINTS: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)       # this program's channels
    n = tl.arange(0, N_PAD)
    d_ok = d < dim
    n_ok = n < N
    gB = (d // per_group_B).to(tl.int64)                          # the group of B each channel reads
    gC = (d // per_group_C).to(tl.int64)                          # (B and C may be grouped differently)
    d = d.to(tl.int64)

    # per-channel constants, float32: A (BLOCK_D, N_PAD); padded entries 0 (so exp(ΔA) = 1)
    A = tl.load(A_ptr + d[:, None] * s_ad + n[None, :] * s_an,
                mask=d_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d * s_bias, mask=d_ok, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d * s_D, mask=d_ok, other=0.0).to(tl.float32)

    B_base = B_ptr + b * s_Bb + gB[:, None, None] * s_Bg + n[None, :, None] * s_Bn
    C_base = C_ptr + b * s_Cb + gC[:, None, None] * s_Cg + n[None, :, None] * s_Cn
    # checkpoints (batch, D, n_chunks, N) float32: the state entering each chunk, for the backward
    n_chunks = tl.cdiv(L, CHUNK)
    ckpt_base = ckpt_ptr + ((b * dim + d[:, None]) * n_chunks) * N + n[None, :]
    t_loc = tl.arange(0, CHUNK)
    h = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)              # the carried state, in registers

    for c0 in range(0, L, CHUNK):
        t = c0 + t_loc
        t_ok = t < L
        m2 = d_ok[:, None] & t_ok[None, :]                                     # (BLOCK_D, CHUNK)
        m3 = d_ok[:, None, None] & n_ok[None, :, None] & t_ok[None, None, :]   # (BLOCK_D, N_PAD, CHUNK)

        # -- 0. (training only) checkpoint: the state entering this chunk, N floats per channel
        if STORE_CHECKPOINTS:
            tl.store(ckpt_base + (c0 // CHUNK) * N, h, mask=d_ok[:, None] & n_ok[None, :])

        # -- 1. load the chunk; Δ = softplus(delta + bias), 0 outside (so the step is the identity)
        u = tl.load(u_ptr + b * s_ub + d[:, None] * s_ud + t[None, :] * s_ul, mask=m2, other=0.0).to(tl.float32)
        dt, _ = _step_size(delta_ptr + b * s_db + d[:, None] * s_dd + t[None, :] * s_dl, m2, bias,
                           HAS_BIAS, SOFTPLUS)
        Bt = tl.load(B_base + t[None, None, :] * s_Bl, mask=m3, other=0.0).to(tl.float32)
        Ct = tl.load(C_base + t[None, None, :] * s_Cl, mask=m3, other=0.0).to(tl.float32)

        # -- 2. discretise: Ā = exp(Δ A) (zero-order hold), B̄u = Δ B u (as the reference)
        dA = tl.exp(dt[:, None, :] * A[:, :, None])
        dBu = (dt * u)[:, None, :] * Bt

        # -- 3. scan inside the chunk: P_t = Π Ā, S_t = the state built from zero within the chunk
        P, S = tl.associative_scan((dA, dBu), 2, _combine)

        # -- 4. fold in the carried state: x_t = P_t h + S_t
        x = P * h[:, :, None] + S

        # -- 5. read out, skip connection, gate, store
        y = tl.sum(x * Ct, axis=1)                                             # (BLOCK_D, CHUNK)
        if HAS_D:
            y = y + Dv[:, None] * u
        if HAS_Z:
            zz = tl.load(z_ptr + b * s_zb + d[:, None] * s_zd + t[None, :] * s_zl,
                         mask=m2, other=0.0).to(tl.float32)
            y = y * (zz / (1.0 + tl.exp(-zz)))                                 # silu(z) = z σ(z)
        tl.store(out_ptr + b * s_ob + d[:, None] * s_od + t[None, :] * s_ol,
                 y.to(out_ptr.dtype.element_ty), mask=m2)

        # -- 6. carry the state at the chunk's last step (steps past L were the identity)
        h = tl.sum(tl.where(t_loc[None, None, :] == CHUNK - 1, x, 0.0), axis=2)

    if STORE_LAST:
        tl.store(last_ptr + b * dim * N + d[:, None] * N + n[None, :], h,
                 mask=d_ok[:, None] & n_ok[None, :])


@triton.jit
def _selective_scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, ckpt_ptr, dout_ptr, dlast_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, dbias_ptr,
    dim, L, N, per_group_B, per_group_C,
    s_ub, s_ud, s_ul,
    s_db, s_dd, s_dl,
    s_ad, s_an,
    s_Bb, s_Bg, s_Bn, s_Bl,
    s_Cb, s_Cg, s_Cn, s_Cl,
    s_D, s_bias,
    s_zb, s_zd, s_zl,
    s_gb, s_gd, s_gl,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_DLAST: tl.constexpr, B_CONST: tl.constexpr, C_CONST: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    """The backward of ``_selective_scan_kernel`` (module docstring, "The backward"). Inputs as the
    forward's (any strides), ``dout`` with strides ``s_g*``. The gradient buffers are contiguous:
    ``du``, ``ddelta``, ``dz`` ``(batch, D, L)``; per ``(b, d)`` partial sums ``dA`` ``(batch, D, N)``,
    ``dD``, ``dbias`` ``(batch, D)``; ``dB`` (``dC``) ``(batch, D, N)`` partial sums when time-invariant
    (``B_CONST``), else a zeroed float32 ``(batch, G, N, L)`` buffer that the channels add into."""
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)       # this program's channels
    n = tl.arange(0, N_PAD)
    d_ok = d < dim
    n_ok = n < N
    dn_ok = d_ok[:, None] & n_ok[None, :]                          # (BLOCK_D, N_PAD)
    grp_B = (d // per_group_B).to(tl.int64)
    grp_C = (d // per_group_C).to(tl.int64)
    d = d.to(tl.int64)

    A = tl.load(A_ptr + d[:, None] * s_ad + n[None, :] * s_an, mask=dn_ok, other=0.0).to(tl.float32)
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d * s_bias, mask=d_ok, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d * s_D, mask=d_ok, other=0.0).to(tl.float32)

    B_base = B_ptr + b * s_Bb + grp_B[:, None, None] * s_Bg + n[None, :, None] * s_Bn
    C_base = C_ptr + b * s_Cb + grp_C[:, None, None] * s_Cg + n[None, :, None] * s_Cn
    delta_base = delta_ptr + b * s_db + d[:, None] * s_dd
    grad_base = (b * dim + d[:, None]) * L                         # row (b, d) of du, ddelta, dz
    n_chunks = tl.cdiv(L, CHUNK)
    ckpt_base = ckpt_ptr + ((b * dim + d[:, None]) * n_chunks) * N + n[None, :]
    # rows (b, group, n) of the shared dB, dC buffers (batch, G, N, L)
    dB_rows = dB_ptr + ((b * (dim // per_group_B) + grp_B[:, None, None]) * N + n[None, :, None]) * L
    dC_rows = dC_ptr + ((b * (dim // per_group_C) + grp_C[:, None, None]) * N + n[None, :, None]) * L
    t_loc = tl.arange(0, CHUNK)

    # the adjoint after the last step: the last state's gradient (when the loss reads the last state)
    g_after = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    if HAS_DLAST:
        g_after = tl.load(dlast_ptr + (b * dim + d[:, None]) * N + n[None, :], mask=dn_ok, other=0.0)
    # sums over the chunks, kept in registers and stored once
    dA_acc = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    dB_acc = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    dC_acc = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    dD_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)

    for i in range(n_chunks):
        c = n_chunks - 1 - i                                       # the chunks from last to first
        t = c * CHUNK + t_loc
        t_ok = t < L
        m2 = d_ok[:, None] & t_ok[None, :]                                     # (BLOCK_D, CHUNK)
        m3 = d_ok[:, None, None] & n_ok[None, :, None] & t_ok[None, None, :]   # (BLOCK_D, N_PAD, CHUNK)

        # -- 1. reload the chunk as the forward did, and its checkpoint: the state before the chunk
        u = tl.load(u_ptr + b * s_ub + d[:, None] * s_ud + t[None, :] * s_ul, mask=m2, other=0.0).to(tl.float32)
        dt, x_pre = _step_size(delta_base + t[None, :] * s_dl, m2, bias, HAS_BIAS, SOFTPLUS)
        Bt = tl.load(B_base + t[None, None, :] * s_Bl, mask=m3, other=0.0).to(tl.float32)
        Ct = tl.load(C_base + t[None, None, :] * s_Cl, mask=m3, other=0.0).to(tl.float32)
        h0 = tl.load(ckpt_base + c * N, mask=dn_ok, other=0.0)

        # -- 2. recompute the chunk's states, as the forward's steps 2-4: x_t = P_t h0 + S_t
        dA = tl.exp(dt[:, None, :] * A[:, :, None])
        dBu = (dt * u)[:, None, :] * Bt
        P, S = tl.associative_scan((dA, dBu), 2, _combine)
        x = P * h0[:, :, None] + S

        # -- 3. back through the gate and the skip: dy = ∂loss/∂y, then dz and D's share
        dout = tl.load(dout_ptr + b * s_gb + d[:, None] * s_gd + t[None, :] * s_gl,
                       mask=m2, other=0.0).to(tl.float32)
        dy = dout
        if HAS_Z:
            zz = tl.load(z_ptr + b * s_zb + d[:, None] * s_zd + t[None, :] * s_zl,
                         mask=m2, other=0.0).to(tl.float32)
            sig = tl.sigmoid(zz)
            y = tl.sum(x * Ct, axis=1)                             # out before the gate
            if HAS_D:
                y = y + Dv[:, None] * u
            dz = dout * y * sig * (1.0 + zz * (1.0 - sig))         # silu'(z) = σ(z) (1 + z (1 - σ(z)))
            tl.store(dz_ptr + grad_base + t[None, :], dz.to(dz_ptr.dtype.element_ty), mask=m2)
            dy = dout * zz * sig
        if HAS_D:
            dD_acc += tl.sum(dy * u, axis=1)

        # -- 4. the adjoint, backwards in time: g_t = C_t dy_t + Ā_{t+1} g_{t+1}, a reversed scan of
        #       (Ā_{t+1}, C_t dy_t). Ā_{t+1} from Δ reloaded one step later (0 past L: Ā = 1); past
        #       the chunk's end, the adjoint carried from the chunk after, g_after, comes in
        dt_next, _ = _step_size(delta_base + (t + 1)[None, :] * s_dl, d_ok[:, None] & (t + 1 < L)[None, :], bias,
                                HAS_BIAS, SOFTPLUS)
        dA_next = tl.exp(dt_next[:, None, :] * A[:, :, None])
        Pg, Sg = tl.associative_scan((dA_next, Ct * dy[:, None, :]), 2, _combine, reverse=True)
        g = Pg * g_after[:, :, None] + Sg
        g_after = tl.sum(tl.where(t_loc[None, None, :] == 0, g, 0.0), axis=2)   # for the chunk before

        # -- 5. the chunk's gradients. Ā_t h_{t-1} = x_t - B̄u_t: the state before each step, unshifted
        g_dot_B = tl.sum(g * Bt, axis=1)                           # Σ_n g_t[n] B_t[n]    (BLOCK_D, CHUNK)
        g_decay = g * (x - dBu)                                    # g_t Ā_t h_{t-1}      (BLOCK_D, N_PAD, CHUNK)
        du = dt * g_dot_B
        if HAS_D:
            du += Dv[:, None] * dy
        ddt = tl.sum(g_decay * A[:, :, None], axis=1) + u * g_dot_B  # ∂loss/∂Δ_t
        if SOFTPLUS:
            ddt = ddt * tl.where(x_pre <= 20.0, tl.sigmoid(x_pre), 1.0)
        ddt = tl.where(m2, ddt, 0.0)                               # steps past L: not Δs, zero them
        tl.store(du_ptr + grad_base + t[None, :], du.to(du_ptr.dtype.element_ty), mask=m2)
        tl.store(ddelta_ptr + grad_base + t[None, :], ddt.to(ddelta_ptr.dtype.element_ty), mask=m2)
        if HAS_BIAS:
            dbias_acc += tl.sum(ddt, axis=1)
        dA_acc += tl.sum(g_decay * dt[:, None, :], axis=2)
        dB_t = g * (dt * u)[:, None, :]                            # ∂loss/∂B_t for each channel
        dC_t = x * dy[:, None, :]                                  # ∂loss/∂C_t for each channel
        # a group's channels add up (relaxed atomics: nothing reads the sums before the kernel ends)
        if B_CONST:
            dB_acc += tl.sum(dB_t, axis=2)
        else:
            tl.atomic_add(dB_rows + t[None, None, :], dB_t, mask=m3, sem="relaxed")
        if C_CONST:
            dC_acc += tl.sum(dC_t, axis=2)
        else:
            tl.atomic_add(dC_rows + t[None, None, :], dC_t, mask=m3, sem="relaxed")

    # -- the sums over time, one per (b, d): the launcher adds up the batch
    dn_offs = (b * dim + d[:, None]) * N + n[None, :]
    tl.store(dA_ptr + dn_offs, dA_acc, mask=dn_ok)
    if B_CONST:
        tl.store(dB_ptr + dn_offs, dB_acc, mask=dn_ok)
    if C_CONST:
        tl.store(dC_ptr + dn_offs, dC_acc, mask=dn_ok)
    if HAS_D:
        tl.store(dD_ptr + b * dim + d, dD_acc, mask=d_ok)
    if HAS_BIAS:
        tl.store(dbias_ptr + b * dim + d, dbias_acc, mask=d_ok)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _as_groups(X: torch.Tensor, batch: int, dim: int, L: int, N: int) -> torch.Tensor:
    """``B`` or ``C`` in any form as a ``(batch, G, N, L)`` view (no copy: strides may be 0)."""
    if X.ndim == 2:                                             # (D, N): G = D, constant in b and t
        return X[None, :, :, None].expand(batch, dim, N, L)
    if X.ndim == 3:                                             # (B, N, L): G = 1
        return X[:, None]
    return X


def choose_tiles(dim: int, N: int, L: int, chunk: int | None = None, block_d: int | None = None):
    """``(BLOCK_D, N_PAD, CHUNK)``: ``N`` rounded up to a power of two; by default a chunk of up to
    64 steps (at most ``L`` rounded up) and as many channels as keep the tile within :data:`MAX_TILE`."""
    n_pad = triton.next_power_of_2(N)
    if chunk is None:
        chunk = max(1, min(64, triton.next_power_of_2(L), MAX_TILE // n_pad))
    if block_d is None:
        block_d = max(1, min(triton.next_power_of_2(dim), MAX_TILE // (n_pad * chunk)))
    return block_d, n_pad, chunk


def _forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, tiles, checkpoints):
    """Launch the forward kernel: ``(out, last or None, checkpoints or None)``."""
    batch, dim, L = u.shape
    N = A.shape[1]
    BLOCK_D, N_PAD, CHUNK = tiles
    Bg = _as_groups(B, batch, dim, L, N)
    Cg = _as_groups(C, batch, dim, L, N)
    out = torch.empty_like(u, memory_format=torch.contiguous_format)
    last = torch.empty((batch, dim, N), dtype=torch.float32, device=u.device) if return_last_state else None
    ckpt = (torch.empty((batch, dim, triton.cdiv(L, CHUNK), N), dtype=torch.float32, device=u.device)
            if checkpoints else None)
    dummy = u                                               # stands for absent optional tensors
    Dt = D if D is not None else dummy.new_empty(1)
    zt = z if z is not None else dummy
    bt = delta_bias if delta_bias is not None else dummy.new_empty(1)

    grid = (batch, triton.cdiv(dim, BLOCK_D))
    _selective_scan_kernel[grid](
        u, delta, A, Bg, Cg, Dt, zt, bt, out, last if last is not None else out, ckpt if ckpt is not None else out,
        dim, L, N, dim // Bg.shape[1], dim // Cg.shape[1],
        *u.stride(), *delta.stride(), *A.stride(), *Bg.stride(), *Cg.stride(),
        Dt.stride(0), bt.stride(0), *zt.stride(), *out.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        SOFTPLUS=delta_softplus, STORE_LAST=return_last_state, STORE_CHECKPOINTS=checkpoints,
        BLOCK_D=BLOCK_D, N_PAD=N_PAD, CHUNK=CHUNK,
    )
    return out, last, ckpt


def _bc_grad(buf: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """The kernel's float32 ``dB`` (``dC``) buffer as the gradient of ``X``, in its form and dtype."""
    if X.ndim == 2:                        # (batch, D, N) partial sums over time -> (D, N)
        return buf.sum(0).to(X.dtype)
    if X.ndim == 3:                        # (batch, 1, N, L) -> (batch, N, L)
        return buf[:, 0].to(X.dtype)
    return buf.to(X.dtype)


def _backward(saved, dout, dlast, delta_softplus, tiles):
    """Launch the backward kernel: the gradients of ``u, delta, A, B, C, D, z, delta_bias``."""
    u, delta, A, B, C, D, z, delta_bias, ckpt = saved
    batch, dim, L = u.shape
    N = A.shape[1]
    BLOCK_D, N_PAD, CHUNK = tiles
    Bg = _as_groups(B, batch, dim, L, N)
    Cg = _as_groups(C, batch, dim, L, N)
    f32 = {"dtype": torch.float32, "device": u.device}

    def bc_buffer(X, G):                   # partial sums per (b, d) or the shared (batch, G, N, L) sums
        return torch.empty((batch, dim, N), **f32) if X.ndim == 2 else torch.zeros((batch, G, N, L), **f32)

    du = torch.empty_like(u, memory_format=torch.contiguous_format)
    ddelta = torch.empty_like(delta, memory_format=torch.contiguous_format)
    dz = torch.empty_like(z, memory_format=torch.contiguous_format) if z is not None else None
    dA = torch.empty((batch, dim, N), **f32)
    dB, dC = bc_buffer(B, Bg.shape[1]), bc_buffer(C, Cg.shape[1])
    dD = torch.empty((batch, dim), **f32) if D is not None else None
    dbias = torch.empty((batch, dim), **f32) if delta_bias is not None else None
    if dlast is not None:
        dlast = dlast.to(torch.float32).contiguous()
    dummy = dA                                              # stands for absent optional tensors
    Dt = D if D is not None else dummy.new_empty(1)
    zt = z if z is not None else u
    bt = delta_bias if delta_bias is not None else dummy.new_empty(1)

    grid = (batch, triton.cdiv(dim, BLOCK_D))
    _selective_scan_bwd_kernel[grid](
        u, delta, A, Bg, Cg, Dt, zt, bt, ckpt, dout, dlast if dlast is not None else dummy,
        du, ddelta, dz if dz is not None else du, dA, dB, dC, dD if dD is not None else dummy,
        dbias if dbias is not None else dummy,
        dim, L, N, dim // Bg.shape[1], dim // Cg.shape[1],
        *u.stride(), *delta.stride(), *A.stride(), *Bg.stride(), *Cg.stride(),
        Dt.stride(0), bt.stride(0), *zt.stride(), *dout.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
        HAS_DLAST=dlast is not None, B_CONST=B.ndim == 2, C_CONST=C.ndim == 2,
        BLOCK_D=BLOCK_D, N_PAD=N_PAD, CHUNK=CHUNK, num_warps=BWD_NUM_WARPS,
    )
    return (du, ddelta, dA.sum(0).to(A.dtype), _bc_grad(dB, B), _bc_grad(dC, C),
            dD.sum(0).to(D.dtype) if D is not None else None, dz,
            dbias.sum(0).to(delta_bias.dtype) if delta_bias is not None else None)


class SelectiveScanFunction(torch.autograd.Function):
    """The Triton scan as an autograd function: the forward kernel (which also stores one state per
    chunk), and the backward kernel, which recomputes each chunk's states from it (module docstring).

    ``apply(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, tiles)`` with
    checked inputs (:func:`selective_scan_triton` checks them, then calls this when an input
    requires grad): ``out``, or ``(out, last_state)``."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, tiles):
        out, last, ckpt = _forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
                                   tiles, checkpoints=True)
        # saved: the inputs (no copies) and the checkpoints; never the (batch, D, L, N) states
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, ckpt)
        ctx.delta_softplus, ctx.tiles = delta_softplus, tiles
        ctx.set_materialize_grads(False)       # an unused last state gets no gradient: None, not zeros
        return (out, last) if return_last_state else out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlast=None):
        saved = ctx.saved_tensors
        if dout is None:                       # only the last state was used
            dout = torch.zeros_like(saved[0])
        grads = _backward(saved, dout, dlast, ctx.delta_softplus, ctx.tiles)
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad)) + (None, None, None)


def selective_scan_triton(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                          return_last_state=False, chunk: int | None = None, block_d: int | None = None, *,
                          check_values: bool = True):
    """The selective scan in one Triton launch (module docstring); the arguments and results of
    ``reference.selective_scan_sequential``, plus the tiles ``chunk`` (time steps per chunk) and
    ``block_d`` (channels per program), powers of two, chosen by :func:`choose_tiles` when None.
    ``A`` must be ``<= 0`` (``reference.check_A``: one small read back to the host per call;
    ``check_values=False`` skips it). Differentiable: when an input requires grad (in grad mode)
    the call goes through :class:`SelectiveScanFunction`, whose backward is a Triton kernel too."""
    for name, t in (("u", u), ("delta", delta), ("B", B), ("C", C), ("z", z)):
        if t is not None:
            require_tensor(name, t, dtypes=FLOAT_DTYPES)
    for name, t in (("A", A), ("D", D), ("delta_bias", delta_bias)):
        if t is not None:
            require_tensor(name, t, dtypes=FLOAT_DTYPES + (torch.float64,))
    _, dim, L, N = reference.check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, check_values=False)
    if not isinstance(delta_softplus, bool):
        raise TypeError(f"delta_softplus must be a bool, got {delta_softplus!r}")
    if not isinstance(return_last_state, bool):
        raise TypeError(f"return_last_state must be a bool, got {return_last_state!r}")
    if chunk is not None:
        require_power_of_two("chunk", chunk)
    if block_d is not None:
        require_power_of_two("block_d", block_d)
    reference.check_A(A, check_values)  # last: the one check that reads values (waits for the GPU)
    tiles = choose_tiles(dim, N, L, chunk, block_d)

    inputs = (u, delta, A, B, C, D, z, delta_bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return SelectiveScanFunction.apply(*inputs, delta_softplus, return_last_state, tiles)
    out, last, _ = _forward(*inputs, delta_softplus, return_last_state, tiles, checkpoints=False)
    return (out, last) if return_last_state else out
