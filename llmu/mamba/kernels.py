"""Triton kernel of module 13: the selective scan, chunked, with the state kept on chip.

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

The launcher
------------
Every tensor on the kernel device, floating point (``u``, ``Δ``, ``B``, ``C``, ``z`` float32,
float16 or bfloat16; ``A``, ``D``, ``delta_bias`` any float dtype, read as float32); shapes as
in ``reference.check_scan_inputs`` (the same ``ValueError`` messages). All arithmetic is float32;
``out`` has ``u``'s dtype; the last state is float32 ``(B, D, N)``. Any strides: ``B`` and ``C`` in
all three forms are passed to the kernel as one ``(batch, G, N, L)`` view with strides (a
time-invariant ``(D, N)`` is ``G = D`` groups with stride 0 along batch and time), so nothing is
copied. ``chunk`` and ``block_d`` must be powers of two; by default the launcher keeps a
``BLOCK_D x N x CHUNK`` tile at 2048 elements or fewer. Forward only: training uses the
differentiable torch scan (``reference.selective_scan_parallel``), and an input that requires
grad (with grad mode on) is refused rather than silently cut from the graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmu.checks import FLOAT_DTYPES, require_power_of_two, require_tensor
from llmu.mamba import reference

__all__ = ["selective_scan_triton", "choose_tiles", "MAX_TILE"]

#: The largest ``BLOCK_D x N_PAD x CHUNK`` tile the default tiles use: with 4 warps on a GPU, 16
#: values per thread for each of ``Ā``, ``B̄u``, ``C`` and the scan's outputs.
MAX_TILE = 2048


@triton.jit
def _combine(a1, b1, a2, b2):
    """``(a1, b1) ∘ (a2, b2) = (a1 a2, a2 b1 + b2)``: apply step 1, then step 2."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _selective_scan_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, last_ptr,
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
    STORE_LAST: tl.constexpr,
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
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d * s_bias, mask=d_ok, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d * s_D, mask=d_ok, other=0.0).to(tl.float32)

    B_base = B_ptr + b * s_Bb + gB[:, None, None] * s_Bg + n[None, :, None] * s_Bn
    C_base = C_ptr + b * s_Cb + gC[:, None, None] * s_Cg + n[None, :, None] * s_Cn
    t_loc = tl.arange(0, CHUNK)
    h = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)              # the carried state, in registers

    for c0 in range(0, L, CHUNK):
        t = c0 + t_loc
        t_ok = t < L
        m2 = d_ok[:, None] & t_ok[None, :]                                     # (BLOCK_D, CHUNK)
        m3 = d_ok[:, None, None] & n_ok[None, :, None] & t_ok[None, None, :]   # (BLOCK_D, N_PAD, CHUNK)

        # -- 1. load the chunk; Δ = softplus(delta + bias), 0 outside (so the step is the identity)
        u = tl.load(u_ptr + b * s_ub + d[:, None] * s_ud + t[None, :] * s_ul, mask=m2, other=0.0).to(tl.float32)
        dt = tl.load(delta_ptr + b * s_db + d[:, None] * s_dd + t[None, :] * s_dl,
                     mask=m2, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dt = dt + bias[:, None]
        if SOFTPLUS:
            # log(1 + e^x), and x itself above 20 (as torch's softplus: e^-20 is below fp32's resolution)
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
        dt = tl.where(m2, dt, 0.0)
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


# ----------------------------------------------------------------------------------------------
# Launcher
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


def selective_scan_triton(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                          return_last_state=False, chunk: int | None = None, block_d: int | None = None, *,
                          check_values: bool = True):
    """The selective scan in one Triton launch (module docstring); the arguments and results of
    ``reference.selective_scan_sequential``, plus the tiles ``chunk`` (time steps per chunk) and
    ``block_d`` (channels per program), powers of two, chosen by :func:`choose_tiles` when None.
    ``A`` must be ``<= 0`` (``reference.check_A``: one small read back to the host per call;
    ``check_values=False`` skips it)."""
    for name, t in (("u", u), ("delta", delta), ("B", B), ("C", C), ("z", z)):
        if t is not None:
            require_tensor(name, t, dtypes=FLOAT_DTYPES)
    for name, t in (("A", A), ("D", D), ("delta_bias", delta_bias)):
        if t is not None:
            require_tensor(name, t, dtypes=FLOAT_DTYPES + (torch.float64,))
    batch, dim, L, N = reference.check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, check_values=False)
    if torch.is_grad_enabled():
        for name, t in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                        ("delta_bias", delta_bias)):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name} requires grad, but selective_scan_triton is forward only: train with "
                                 "reference.selective_scan_parallel, or call it under torch.no_grad()")
    if not isinstance(delta_softplus, bool):
        raise TypeError(f"delta_softplus must be a bool, got {delta_softplus!r}")
    if chunk is not None:
        require_power_of_two("chunk", chunk)
    if block_d is not None:
        require_power_of_two("block_d", block_d)
    reference.check_A(A, check_values)  # last: the one check that reads values (waits for the GPU)
    BLOCK_D, N_PAD, CHUNK = choose_tiles(dim, N, L, chunk, block_d)

    Bg = _as_groups(B, batch, dim, L, N)
    Cg = _as_groups(C, batch, dim, L, N)
    out = torch.empty_like(u, memory_format=torch.contiguous_format)
    last = torch.empty((batch, dim, N), dtype=torch.float32, device=u.device) if return_last_state else out
    dummy = u                                               # stands for absent optional tensors
    Dt = D if D is not None else dummy.new_empty(1)
    zt = z if z is not None else dummy
    bt = delta_bias if delta_bias is not None else dummy.new_empty(1)

    grid = (batch, triton.cdiv(dim, BLOCK_D))
    _selective_scan_kernel[grid](
        u, delta, A, Bg, Cg, Dt, zt, bt, out, last,
        dim, L, N, dim // Bg.shape[1], dim // Cg.shape[1],
        *u.stride(), *delta.stride(), *A.stride(), *Bg.stride(), *Cg.stride(),
        Dt.stride(0), bt.stride(0), *zt.stride(), *out.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        SOFTPLUS=delta_softplus, STORE_LAST=return_last_state,
        BLOCK_D=BLOCK_D, N_PAD=N_PAD, CHUNK=CHUNK,
    )
    return (out, last) if return_last_state else out
