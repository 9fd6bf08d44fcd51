"""Triton kernels of module 12: an MoE layer as permute -> grouped GEMM -> unpermute.

The loop in ``reference.moe_reference`` runs ``E`` small MLPs one after the other, each on a
different number of tokens: ``3E`` matmul launches of ragged sizes, and a host synchronisation
per expert to learn how many tokens it has. The GPU-friendly layout sorts the token copies by
expert once, so that every expert's rows are contiguous, and then does all the experts' matmuls
in **one** launch:

1. :func:`permute` — ``x`` ``(T, H)`` and the router's choices ``experts`` ``(T, k)`` give
   ``x_sorted`` ``(T*k, H)``: the rows of expert 0 (in token order), then expert 1, ...; with
   ``counts`` ``(E,)`` and ``offsets`` ``(E+1,)`` (``offsets[e]:offsets[e+1]`` are expert ``e``'s
   rows). The index computation is a counting sort (a histogram and its prefix sum, in torch on
   the host); copying the rows is a Triton kernel, one program per block of rows.
2. :func:`grouped_gemm` — ``out[offsets[e]:offsets[e+1]] = x_sorted[offsets[e]:offsets[e+1]] @ w[e]^T``
   for every ``e`` at once. The programs cover (row tiles of every group) x (column tiles); a small
   table built on the host says which expert and which first row each row tile has. A tile that
   straddles the end of its group masks the extra rows; an expert with no rows gets no tile.
3. ``silu(gate) * up`` — the fused SwiGLU kernel of module 03 (``llmu.layers.swiglu``).
4. :func:`unpermute` — the weighted combine ``y_t = sum_j weights[t, j] * out_sorted[row of (t, j)]``,
   one program per block of tokens, gathering its ``k`` rows (no atomics: deterministic).

:func:`moe_triton` chains them and returns what ``moe_reference`` returns. Dropped assignments
(capacity) never get a row: ``permute`` takes ``-1`` as "no expert".

Weight layout: ``w`` is ``(E, N, K)``, ``nn.Linear``'s ``(out, in)`` per expert, so the stacked
``w_gate``/``w_up`` ``(E, F, H)`` and ``w_down`` ``(E, H, F)`` of the reference go in as they are,
and the kernel computes ``x @ w[e]^T``. The kernel reads ``w`` through its three strides, so a
transposed view (``w.transpose(1, 2)``, ``(E, K, N)`` memory read as ``(E, N, K)``) also works.
A fused ``w_gate_up`` ``(E, 2F, H)`` (gate rows, then up rows) is one ``(E, N = 2F, K = H)`` weight:
one launch computes both projections, ``[gate | up]`` side by side in each row of the output.

The napkin math
---------------
Mixtral-8x7B's MoE layer (``H = 4096``, ``F = 14336``, ``E = 8``, ``k = 2``), bf16, on an H200
(about 990 TFLOP/s dense bf16, 4.8 TB/s):

- **prefill**, ``T = 4096`` tokens: three GEMMs over ``T*k = 8192`` rows,
  ``FLOPs = 3 * 2 * T*k * H * F = 2.9e12`` (2.9 ms); expert weights ``3 * E * H * F * 2 B = 2.8 GB``
  (0.59 ms). Compute-bound: what matters is that the grouped GEMM keeps tensor cores as busy as one
  big GEMM would. Ragged groups waste at most ``E * (BLOCK_M - 1)`` padded rows of ``8192``.
- **decode**, ``T = 8``: 16 assignments land on about 7 of the 8 experts (``8 (1 - (7/8)^16)``
  on average), so nearly all 2.8 GB of weights are read for ``6 * 16 * H * F = 5.6e9`` FLOPs:
  memory-bound, ~0.5 ms per layer. One launch per projection instead of one per expert also saves
  ``~3E = 24`` launch latencies (several microseconds each).
- **permute/unpermute** each read and write ``T*k*H`` elements: at ``T = 4096``,
  ``2 * 8192 * 4096 * 2 B = 134 MB``, about 30 us: small next to the GEMMs.

Host synchronisations: these launchers read a few numbers back per call (the number of kept
rows, the number of row tiles = the grid size, the range checks of the ids), as the reference
does per expert. A production kernel launches a grid bounded by ``ceil(T*k / BLOCK_M) + E`` tiles
and lets the surplus programs exit, so nothing waits for the host.

Backward
--------
Every step is an autograd function, so ``moe_triton`` trains like the reference:

- grouped GEMM ``out_e = X_e W_e^T``: ``dX_e = dOut_e W_e`` is the same kernel reading ``w``
  through its transposed view (no copy); ``dW_e = dOut_e^T X_e`` is :func:`grouped_gemm_dw`, one
  program per (expert, ``N`` tile, ``K`` tile) that walks its expert's rows;
- permute (a gather) and unpermute (a weighted sum) are each other's transposes: the gradient of
  permute is unpermute with weights 1, the gradient of unpermute gathers ``d out`` rows back into
  expert order and scales them by the gate weights; the gate weights' own gradient, a row-wise dot
  ``<d out_t, y_sorted_i>``, is left to torch;
- SwiGLU: module 03's forward and backward kernels;
- the router: torch (``reference.route``).

Launchers check shapes, dtypes, devices and index ranges and raise ``ValueError`` naming the
argument (``TypeError`` for a wrong dtype). In the interpreter, bfloat16 is refused (numpy has no
bfloat16 matmul); float32 and float16 work everywhere.
"""

from __future__ import annotations  # noqa: I001  (kernel lines are part of Triton's compile hash)

import torch
import triton
import triton.language as tl

from llmu import runtime
from llmu.checks import (FLOAT_DTYPES, require_positive, require_power_of_two, require_same_device,
                         require_same_dtype, require_tensor)
from llmu.moe import reference

__all__ = ["permute", "unpermute", "grouped_gemm", "grouped_gemm_dw", "moe_triton", "sort_by_expert", "gather_rows",
           "tile_map", "default_blocks", "INDEX_DTYPES"]

#: dtypes accepted for ``experts``, ``order`` and ``offsets``.
INDEX_DTYPES = (torch.int32, torch.int64)
BLOCK_ROWS = 16      # rows per program of the copy kernels
BLOCK_H = 128        # columns per program of the copy kernels (H is a grid dimension: any width works)


def default_blocks() -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` of the grouped GEMM: 64x64x32 tiles compiled (a common
    starting point for fp16/bf16 tensor cores), 32x32x32 in the interpreter (fewer, smaller numpy
    steps; tile sizes do not change results beyond summation order)."""
    return (32, 32, 32) if runtime.interpreting() else (64, 64, 32)


# ----------------------------------------------------------------------------------------------
# Permute: gather rows into expert order
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gather_rows_kernel(
    X, SRC, Y,
    M, H,
    stride_x, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Step 1: program (i, j) writes rows [i*BLOCK_M, (i+1)*BLOCK_M) of Y, columns of block j.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < M
    cmask = cols < H
    # Step 2: which row of X each output row copies (the token of that assignment).
    src = tl.load(SRC + rows, mask=rmask, other=0).to(tl.int64)
    mask = rmask[:, None] & cmask[None, :]
    # Step 3: a gathered load, a contiguous store.
    tile = tl.load(X + src[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    tl.store(Y + rows[:, None].to(tl.int64) * stride_y + cols[None, :], tile, mask=mask)


def gather_rows(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Launch the row-copy kernel: ``x[src]`` for ``x`` ``(T, H)`` and ``src`` ``(M,)`` row ids in ``[0, T)``.

    Not differentiable by itself (:func:`permute` wraps it in an autograd function); ids are not
    range-checked here (callers build them).
    """
    require_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("src", src, ndim=1, dtypes=INDEX_DTYPES)
    require_same_device(x=x, src=src)
    m, hidden = src.numel(), x.shape[1]
    out = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
    if out.numel():
        grid = (triton.cdiv(m, BLOCK_ROWS), triton.cdiv(hidden, BLOCK_H))
        _gather_rows_kernel[grid](x, src, out, m, hidden, x.stride(0), out.stride(0),
                                  BLOCK_M=BLOCK_ROWS, BLOCK_H=BLOCK_H)
    return out


def sort_by_expert(experts: torch.Tensor, num_experts: int):
    """The index half of :func:`permute`, in torch: ``(order, counts, offsets)``.

    A counting sort: ``counts = bincount(experts)`` (the histogram), ``offsets`` its exclusive
    prefix sum, and ``order`` the flattened assignment indices sorted by expert with a *stable*
    sort (token order inside an expert). Assignments marked ``-1`` are left out. Plain torch: it
    runs on any device (the torch providers and expert parallelism call it on CPU tensors too).
    """
    require_tensor("experts", experts, ndim=2, dtypes=INDEX_DTYPES, device=None)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    flat = experts.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < -1 or int(flat.max()) >= num_experts):
        raise ValueError(f"experts must hold expert ids in [0, {num_experts}) or -1 (dropped), "
                         f"got values in [{int(flat.min())}, {int(flat.max())}]")
    kept = flat >= 0
    counts = torch.bincount(flat[kept], minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=experts.device)
    offsets[1:] = counts.cumsum(0)
    key = torch.where(kept, flat, num_experts)            # dropped ones sort last, then are cut off
    order = torch.sort(key, stable=True).indices[: int(offsets[-1])]
    return order, counts, offsets


class _Permute(torch.autograd.Function):
    """``x_sorted = x[order // k]``; backward: each token sums the gradients of its copies, which
    is :func:`unpermute` with all weights 1."""

    @staticmethod
    def forward(ctx, x, order, k):
        ctx.k, ctx.num_tokens = k, x.shape[0]
        ctx.save_for_backward(order)
        return gather_rows(x, order // k)

    @staticmethod
    def backward(ctx, d_sorted):
        (order,) = ctx.saved_tensors
        ones = torch.ones((ctx.num_tokens, ctx.k), dtype=torch.float32, device=d_sorted.device)
        return _combine(d_sorted.contiguous(), order, ones, ctx.num_tokens), None, None


def permute(x: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """Group the token copies by expert: ``(x_sorted, order, counts, offsets)``.

    ``x``: ``(T, H)``; ``experts``: ``(T, k)`` int32/int64 with values in ``[0, E)``, or ``-1``
    for an assignment that gets no row (dropped by capacity). With ``M`` kept assignments
    (``T*k`` without drops):

    - ``order`` ``(M,)`` int64: row ``i`` of ``x_sorted`` is assignment ``order[i]`` of the
      flattened ``(T, k)`` tensor, i.e. token ``order[i] // k``, choice ``order[i] % k``; sorted by
      expert, and *stable* (token order inside an expert);
    - ``x_sorted`` ``(M, H)``: ``x[order // k]``, copied by a Triton kernel (differentiable in ``x``);
    - ``counts`` ``(E,)`` int64: rows per expert (the histogram); ``offsets`` ``(E+1,)`` int64:
      its exclusive prefix sum, ``offsets[e]:offsets[e+1]`` being expert ``e``'s rows.
    """
    require_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("experts", experts, ndim=2, dtypes=INDEX_DTYPES)
    require_same_device(x=x, experts=experts)
    if experts.shape[0] != x.shape[0]:
        raise ValueError(f"experts must be (T={x.shape[0]}, k), got shape {tuple(experts.shape)}")
    order, counts, offsets = sort_by_expert(experts, num_experts)
    x_sorted = _Permute.apply(x, order, max(experts.shape[1], 1))
    return x_sorted, order, counts, offsets


# ----------------------------------------------------------------------------------------------
# Unpermute: the weighted combine
# ----------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(
    YS, INV, W, OUT,
    T, H, K,
    stride_ys, stride_wt, stride_wk, stride_out,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Step 1: program (i, j) owns tokens [i*BLOCK_T, (i+1)*BLOCK_T), columns of block j.
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = toks < T
    cmask = cols < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    # Step 2: for each of the k choices, find its row in YS (-1: dropped, adds nothing) ...
    for j in range(K):
        idx = tl.load(INV + toks.to(tl.int64) * K + j, mask=tmask, other=-1).to(tl.int64)
        valid = tmask & (idx >= 0)
        w = tl.load(W + toks * stride_wt + j * stride_wk, mask=valid, other=0.0).to(tl.float32)
        rows = tl.load(YS + idx[:, None] * stride_ys + cols[None, :],
                       mask=valid[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        # Step 3: ... and add it with its gate weight, in float32.
        acc += w[:, None] * rows
    tl.store(OUT + toks[:, None].to(tl.int64) * stride_out + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


def _combine(y_sorted, order, weights, num_tokens):
    """Launch the combine kernel (inputs already checked)."""
    k = weights.shape[1]
    m, hidden = y_sorted.shape
    inv = torch.full((num_tokens * k,), -1, dtype=torch.int64, device=y_sorted.device)
    inv[order.to(torch.int64)] = torch.arange(m, device=y_sorted.device)
    out = torch.empty((num_tokens, hidden), dtype=y_sorted.dtype, device=y_sorted.device)
    if out.numel():
        grid = (triton.cdiv(num_tokens, BLOCK_ROWS), triton.cdiv(hidden, BLOCK_H))
        _combine_kernel[grid](y_sorted, inv, weights, out, num_tokens, hidden, k,
                              y_sorted.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
                              BLOCK_T=BLOCK_ROWS, BLOCK_H=BLOCK_H)
    return out


class _Unpermute(torch.autograd.Function):
    """``out[t] = sum_j w[t, j] * y_sorted[row(t, j)]``. Backward, with ``t, j`` the token and
    choice of row ``i``: ``d y_sorted[i] = w[t, j] * d out[t]`` (the rows gathered by the copy
    kernel, scaled in torch) and ``d w[t, j] = <d out[t], y_sorted[i]>`` (a row-wise dot, torch)."""

    @staticmethod
    def forward(ctx, y_sorted, order, weights, num_tokens):
        ctx.save_for_backward(y_sorted, order, weights)
        ctx.num_tokens = num_tokens
        return _combine(y_sorted, order, weights, num_tokens)

    @staticmethod
    def backward(ctx, d_out):
        y_sorted, order, weights = ctx.saved_tensors
        k = weights.shape[1]
        tok, slot = order // k, order % k
        d_rows = gather_rows(d_out.contiguous(), tok)
        d_y = d_w = None
        if ctx.needs_input_grad[0]:
            d_y = (d_rows.float() * weights[tok, slot, None].float()).to(y_sorted.dtype)
        if ctx.needs_input_grad[2]:
            d_w = torch.zeros(weights.shape, dtype=torch.float32, device=weights.device)
            d_w[tok, slot] = (d_rows.float() * y_sorted.float()).sum(-1)
            d_w = d_w.to(weights.dtype)
        return d_y, None, d_w, None


def unpermute(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The weighted combine: ``out[t] = sum_j weights[t, j] * y_sorted[i]`` where ``order[i] = t*k + j``.

    ``y_sorted``: ``(M, H)`` in ``permute``'s row order; ``order``: ``(M,)`` from :func:`permute`;
    ``weights``: ``(T, k)`` float (``T = num_tokens``). Assignments absent from ``order`` (dropped)
    add nothing. The launcher inverts ``order`` (``inv[order[i]] = i``, ``-1`` elsewhere) so each
    program *gathers* its tokens' ``k`` rows: no atomic adds, the same bits on every run. Sums in
    float32; returns ``(T, H)`` in ``y_sorted``'s dtype. Differentiable in ``y_sorted`` and
    ``weights`` (the router learns through the latter).
    """
    require_tensor("y_sorted", y_sorted, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("order", order, ndim=1, dtypes=INDEX_DTYPES)
    require_tensor("weights", weights, ndim=2, dtypes=FLOAT_DTYPES)
    require_same_device(y_sorted=y_sorted, order=order, weights=weights)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    if weights.shape[0] != num_tokens:
        raise ValueError(f"weights must be (T={num_tokens}, k), got shape {tuple(weights.shape)}")
    k = weights.shape[1]
    m = y_sorted.shape[0]
    if order.numel() != m:
        raise ValueError(f"order must have one entry per row of y_sorted ({m}), got {order.numel()}")
    if m and (int(order.min()) < 0 or int(order.max()) >= num_tokens * k):
        raise ValueError(f"order must hold assignment indices in [0, T*k={num_tokens * k}), "
                         f"got values in [{int(order.min())}, {int(order.max())}]")
    if m and torch.unique(order).numel() != m:
        raise ValueError("order must not repeat an assignment index")
    return _Unpermute.apply(y_sorted, order, weights, num_tokens)


# ----------------------------------------------------------------------------------------------
# Grouped GEMM
# ----------------------------------------------------------------------------------------------


@triton.jit
def _grouped_gemm_kernel(
    X, W, OUT, OFFSETS, TILE_EXPERT, TILE_ROW,
    N, K,
    stride_xm, stride_xk,
    stride_we, stride_wn, stride_wk,
    stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Step 1: which expert and which rows this program's row tile covers (from the host's table).
    tile = tl.program_id(0)
    e = tl.load(TILE_EXPERT + tile).to(tl.int64)
    row0 = tl.load(TILE_ROW + tile).to(tl.int64)
    row_end = tl.load(OFFSETS + e + 1).to(tl.int64)      # end of the group: mask rows past it
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < row_end
    cmask = cols < N
    w_e = W + e * stride_we
    # Step 2: acc = x[rows] @ w[e][cols]^T, BLOCK_K columns of the reduction at a time, in float32.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        a = tl.load(X + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=rmask[:, None] & kmask[None, :], other=0.0)          # (BLOCK_M, BLOCK_K)
        b = tl.load(w_e + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=kmask[:, None] & cmask[None, :], other=0.0)          # (BLOCK_K, BLOCK_N) = w[e]^T tile
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    # Step 3: store the tile in the output dtype; rows of the next group are left to its tiles.
    tl.store(OUT + rows[:, None] * stride_om + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _grouped_gemm_dw_kernel(
    DY, X, DW, OFFSETS,
    N, K,
    stride_dym, stride_dyn,
    stride_xm, stride_xk,
    stride_we, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Step 1: program (e, i, j) owns tile (i, j) of dW[e], an (N, K) matrix.
    e = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    nmask = ns < N
    kmask = ks < K
    start = tl.load(OFFSETS + e).to(tl.int64)
    end = tl.load(OFFSETS + e + 1).to(tl.int64)
    # Step 2: dW[e] = dY_e^T X_e, a sum over the group's rows, BLOCK_M rows at a time
    # (an empty group runs no iteration and stores zeros).
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < end
        dy_t = tl.load(DY + rows[None, :] * stride_dym + ns[:, None] * stride_dyn,
                       mask=nmask[:, None] & rmask[None, :], other=0.0)       # (BLOCK_N, BLOCK_M) = dY^T tile
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=rmask[:, None] & kmask[None, :], other=0.0)          # (BLOCK_M, BLOCK_K)
        acc = tl.dot(dy_t, x, acc, input_precision=PRECISION)
    tl.store(DW + e * stride_we + ns[:, None] * stride_wn + ks[None, :] * stride_wk,
             acc.to(DW.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


def tile_map(offsets: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped GEMM's row-tile table: ``(tile_expert, tile_row)``, one entry per row tile.

    Expert ``e`` with ``n_e = offsets[e+1] - offsets[e]`` rows gets ``ceil(n_e / block_m)`` tiles
    starting at rows ``offsets[e], offsets[e] + block_m, ...``; an expert with no rows gets none.
    Built with torch (one host synchronisation, for the number of tiles = the grid size).
    """
    offsets = offsets.to(torch.int64)
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    num_tiles = int(tiles.sum())
    experts = torch.arange(counts.numel(), device=offsets.device)
    tile_expert = torch.repeat_interleave(experts, tiles, output_size=num_tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles                       # index of each expert's first tile
    rank = torch.arange(num_tiles, device=offsets.device) - first_tile[tile_expert]
    tile_row = offsets[:-1][tile_expert] + rank * block_m
    return tile_expert, tile_row


def _blocks(block_m, block_n, block_k) -> tuple[int, int, int]:
    dm, dn, dk = default_blocks()
    out = []
    for name, b, d in (("block_m", block_m, dm), ("block_n", block_n, dn), ("block_k", block_k, dk)):
        b = require_power_of_two(name, d if b is None else b)
        if b < 16:
            raise ValueError(f"{name} must be at least 16 (tl.dot's smallest tile), got {b}")
        out.append(b)
    return tuple(out)


def _check_offsets(offsets: torch.Tensor, num_experts: int, m: int, rows_of: str) -> torch.Tensor:
    if offsets.numel() != num_experts + 1:
        raise ValueError(f"offsets must have E+1 = {num_experts + 1} entries (w has E={num_experts}), "
                         f"got {offsets.numel()}")
    off = offsets.to(torch.int64)
    if int(off[0]) != 0 or int(off[-1]) != m or bool((off[1:] < off[:-1]).any()):
        raise ValueError(f"offsets must start at 0, never decrease and end at M={m} (the rows of {rows_of}), "
                         f"got {off.tolist() if off.numel() <= 16 else 'values that do not'}")
    return off


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"   # float32: no TF32 rounding on a GPU


def _refuse_interpreted_bf16(name: str, t: torch.Tensor) -> None:
    if t.dtype == torch.bfloat16 and runtime.interpreting():
        # the interpreter computes tl.dot with numpy, which has no bfloat16
        raise TypeError(f"{name}: bfloat16 needs a GPU (Triton's interpreter has no bfloat16 tl.dot); "
                        "use float32 or float16 on CPU")


def _grouped_gemm(x_sorted, w, off, blocks):
    """Launch the forward kernel (inputs already checked; ``w`` any strides)."""
    block_m, block_n, block_k = blocks
    m, k_dim = x_sorted.shape
    n = w.shape[1]
    out = torch.empty((m, n), dtype=x_sorted.dtype, device=x_sorted.device)
    if m == 0 or n == 0:
        return out
    if k_dim == 0:
        return out.zero_()
    tile_expert, tile_row = tile_map(off, block_m)
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        x_sorted, w, out, off, tile_expert, tile_row,
        n, k_dim,
        x_sorted.stride(0), x_sorted.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=_precision(x_sorted.dtype),
    )
    return out


def _grouped_gemm_dw(dy, x_sorted, off, num_experts, blocks):
    """Launch the weight-gradient kernel: ``(E, N, K)``, contiguous, in ``x_sorted``'s dtype."""
    block_m, block_n, block_k = blocks
    n, k_dim = dy.shape[1], x_sorted.shape[1]
    dw = torch.empty((num_experts, n, k_dim), dtype=x_sorted.dtype, device=x_sorted.device)
    if dw.numel() == 0:
        return dw
    grid = (num_experts, triton.cdiv(n, block_n), triton.cdiv(k_dim, block_k))
    _grouped_gemm_dw_kernel[grid](
        dy, x_sorted, dw, off,
        n, k_dim,
        dy.stride(0), dy.stride(1),
        x_sorted.stride(0), x_sorted.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=_precision(x_sorted.dtype),
    )
    return dw


class _GroupedGemm(torch.autograd.Function):
    """``out_e = X_e W_e^T`` per group. Backward: ``dX_e = dOut_e W_e`` (the same kernel on the
    transposed view of ``w``: no copy) and ``dW_e = dOut_e^T X_e`` (the weight-gradient kernel)."""

    @staticmethod
    def forward(ctx, x_sorted, w, off, blocks):
        ctx.save_for_backward(x_sorted, w, off)
        ctx.blocks = blocks
        return _grouped_gemm(x_sorted, w, off, blocks)

    @staticmethod
    def backward(ctx, d_out):
        x_sorted, w, off = ctx.saved_tensors
        d_out = d_out.contiguous().to(x_sorted.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_gemm(d_out, w.transpose(1, 2), off, ctx.blocks)
        if ctx.needs_input_grad[1]:
            dw = _grouped_gemm_dw(d_out, x_sorted, off, w.shape[0], ctx.blocks)
        return dx, dw, None, None


def grouped_gemm(x_sorted: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *,
                 block_m: int | None = None, block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """One launch for every expert's matmul: ``out[r] = x_sorted[r] @ w[e]^T`` for ``offsets[e] <= r < offsets[e+1]``.

    ``x_sorted``: ``(M, K)``; ``w``: ``(E, N, K)`` (``nn.Linear`` layout per expert; any strides);
    ``offsets``: ``(E+1,)`` int32/int64, ``offsets[0] = 0``, non-decreasing, ``offsets[E] = M``.
    Returns ``(M, N)`` in ``x_sorted``'s dtype, accumulated in float32 (``"ieee"`` products for
    float32 inputs: no TF32 rounding on a GPU). Grid: (row tiles of all groups, ``ceil(N / block_n)``).
    Block sizes: powers of two >= 16 (``tl.dot``'s smallest tile); defaults from :func:`default_blocks`.
    Differentiable in ``x_sorted`` and ``w`` (see :func:`grouped_gemm_dw`).
    """
    require_tensor("x_sorted", x_sorted, ndim=2, dtypes=FLOAT_DTYPES)
    require_tensor("w", w, ndim=3, dtypes=FLOAT_DTYPES)
    require_tensor("offsets", offsets, ndim=1, dtypes=INDEX_DTYPES)
    require_same_dtype(x_sorted=x_sorted, w=w)  # tl.dot in the interpreter needs one dtype
    require_same_device(x_sorted=x_sorted, w=w, offsets=offsets)
    _refuse_interpreted_bf16("x_sorted", x_sorted)
    m, k_dim = x_sorted.shape
    if w.shape[2] != k_dim:
        raise ValueError(f"w must be (E, N, K={k_dim}) to multiply x_sorted {tuple(x_sorted.shape)}, "
                         f"got shape {tuple(w.shape)}")
    off = _check_offsets(offsets, w.shape[0], m, "x_sorted")
    blocks = _blocks(block_m, block_n, block_k)
    return _GroupedGemm.apply(x_sorted, w, off, blocks)


def grouped_gemm_dw(dy: torch.Tensor, x_sorted: torch.Tensor, offsets: torch.Tensor, num_experts: int, *,
                    block_m: int | None = None, block_n: int | None = None,
                    block_k: int | None = None) -> torch.Tensor:
    """The weight gradient of :func:`grouped_gemm`: ``dw[e] = dy[rows of e]^T @ x_sorted[rows of e]``.

    ``dy``: ``(M, N)``; ``x_sorted``: ``(M, K)``; returns ``(E, N, K)`` (zeros for an expert
    without rows). Grid: ``(E, ceil(N / block_n), ceil(K / block_k))``; each program walks its
    group's rows ``block_m`` at a time, so a program's work is proportional to its expert's load
    (a busy expert is a slow program: fine for a reference backward, not what a tuned kernel does).
    """
    require_tensor("dy", dy, ndim=2, dtypes=FLOAT_DTYPES)
    require_tensor("x_sorted", x_sorted, ndim=2, dtypes=FLOAT_DTYPES)
    require_tensor("offsets", offsets, ndim=1, dtypes=INDEX_DTYPES)
    require_same_dtype(dy=dy, x_sorted=x_sorted)
    require_same_device(dy=dy, x_sorted=x_sorted, offsets=offsets)
    _refuse_interpreted_bf16("x_sorted", x_sorted)
    require_positive("num_experts", num_experts, integer=True)
    if dy.shape[0] != x_sorted.shape[0]:
        raise ValueError(f"dy must have as many rows as x_sorted ({x_sorted.shape[0]}), got shape {tuple(dy.shape)}")
    off = _check_offsets(offsets, num_experts, x_sorted.shape[0], "x_sorted")
    return _grouped_gemm_dw(dy, x_sorted, off, num_experts, _blocks(block_m, block_n, block_k))


# ----------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------


_BLOCK_KEYWORDS = ("block_m", "block_n", "block_k")


def moe_triton(x, router_weight=None, w_gate=None, w_up=None, w_down=None, k: int | None = None, *,
               router_logits=None, w_gate_up=None, renormalize: bool = True,
               capacity_factor: float | None = None, select=None, **blocks):
    """The MoE feed-forward on the kernels above: ``(y, aux)``, as :func:`reference.moe_reference`.

    The router (a ``(T, H) x (H, E)`` matmul, softmax, top-k, capacity, losses) is the reference's
    own :func:`reference.route`, so both paths take the same decisions. Then::

        x_sorted, order, counts, offsets = permute(x, experts (-1 where dropped), E)
        h = silu(grouped_gemm(x_sorted, w_gate, offsets)) * grouped_gemm(x_sorted, w_up, offsets)
        y = unpermute(grouped_gemm(h, w_down, offsets), order, weights, T)

    Arguments as :func:`reference.moe_reference`: ``router_logits=`` ``(..., E)`` instead of
    ``router_weight`` (the router's matmul is then skipped; the gradient reaches the logits), and
    ``w_gate_up=`` ``(E, 2F, H)`` (gate rows first, then up rows) instead of ``w_gate`` and
    ``w_up``. The fused weight is **one** grouped GEMM of width ``2F``; its output's two column
    halves go to the SwiGLU kernel as strided views (no copy), and its backward is one ``dX`` and
    one ``dW`` launch for both projections. Float tensors must be float32/float16/bfloat16, and
    ``x`` and the expert weights one dtype (the router's may differ).

    ``blocks``: ``block_m``/``block_n``/``block_k`` passed to every :func:`grouped_gemm`.
    Differentiable in ``x``, the expert weights and (through the gate weights and the losses in
    ``aux``) the router, every step by its own autograd function.
    """
    from llmu.layers.swiglu import swiglu_fused

    unknown = sorted(set(blocks) - set(_BLOCK_KEYWORDS))
    if unknown:
        raise TypeError(f"moe_triton got unexpected keyword argument(s) {', '.join(unknown)}; "
                        f"tile sizes are {', '.join(_BLOCK_KEYWORDS)}")
    num_experts, _, ffn = reference.check_moe_inputs(x, router_weight, w_gate, w_up, w_down, k,
                                                     router_logits=router_logits, w_gate_up=w_gate_up)
    given = {name: t for name, t in (("x", x), ("router_weight", router_weight), ("router_logits", router_logits),
                                     ("w_gate", w_gate), ("w_up", w_up), ("w_gate_up", w_gate_up),
                                     ("w_down", w_down)) if t is not None}
    for name, t in given.items():
        require_tensor(name, t, dtypes=FLOAT_DTYPES)
    require_same_dtype(**{name: t for name, t in given.items() if name not in ("router_weight", "router_logits")})
    _refuse_interpreted_bf16("x", x)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    aux = reference.route(x2, router_weight, k, router_logits=router_logits, renormalize=renormalize,
                          capacity_factor=capacity_factor, select=select)
    experts = torch.where(aux.dropped, -1, aux.experts)
    # Step 1: one copy of each kept (token, choice) row, grouped by expert
    x_sorted, order, _, offsets = permute(x2, experts, num_experts)
    # Step 2: the experts' gate and up projections, every expert in one launch each (or one for both)
    if w_gate_up is not None:
        gate_up = grouped_gemm(x_sorted, w_gate_up, offsets, **blocks)      # (M, 2F): [gate | up]
        gate, up = gate_up[:, :ffn], gate_up[:, ffn:]
    else:
        gate = grouped_gemm(x_sorted, w_gate, offsets, **blocks)
        up = grouped_gemm(x_sorted, w_up, offsets, **blocks)
    # Step 3: SwiGLU, elementwise (module 03's fused kernel)
    h = swiglu_fused(gate, up)
    # Step 4: down projection, then the gate-weighted sum of each token's k rows
    out_sorted = grouped_gemm(h, w_down, offsets, **blocks)
    y = unpermute(out_sorted, order, aux.weights, x2.shape[0])
    return y.view(x.shape), aux
