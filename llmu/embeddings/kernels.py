"""Triton kernels for module 01: a tiled cosine-similarity matrix, and top-k neighbour search.

``cosine_similarity(a, b)`` computes ``S[i, j] = cos(a_i, b_j)`` for every query row ``a_i`` (Q of
them) against every table row ``b_j`` (V of them) in one kernel. The output is cut into tiles of
``BLOCK_Q x BLOCK_V``; one program computes one tile. Along the way it walks the shared dimension D
in chunks of ``BLOCK_D``, and for each chunk it

- adds the chunk's dot products to the tile with ``tl.dot`` (a small matrix multiply), and
- adds the chunk's squares to the running squared norms of its query rows and its table rows,

so the normalisation costs no extra pass over memory: at the end the tile of dot products is
divided by ``max(|a_i|, eps) * max(|b_j|, eps)``. That clamping is the one
``torch.nn.functional.cosine_similarity`` uses, so a zero vector scores 0, never NaN.

``top_k_neighbours`` runs this kernel and then ``torch.topk`` on the (Q, V) scores: the top-k
selection stays in PyTorch. (A fused kernel would keep a running top-k per query row and never
write the Q x V matrix; for the course's sizes, 49152 x Q floats, writing it is cheap.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmu import runtime
from llmu.checks import FLOAT_DTYPES, require_positive, require_power_of_two, require_same_dtype, require_tensor
from llmu.embeddings.reference import DEFAULT_EPS, _check_k, top_k_of

__all__ = ["cosine_similarity", "top_k_neighbours", "default_blocks"]


@triton.jit
def _cosine_kernel(
    a_ptr, b_ptr, out_ptr,
    Q, V, D,
    stride_aq, stride_bv, stride_oq,
    eps,
    BLOCK_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # 1. This program's tile: query rows rq, table rows rv.
    pid_q = tl.program_id(axis=0)
    pid_v = tl.program_id(axis=1)
    rq = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    rd = tl.arange(0, BLOCK_D)
    q_ok = rq < Q
    v_ok = rv < V

    dots = tl.zeros((BLOCK_Q, BLOCK_V), dtype=tl.float32)
    a_sq = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    b_sq = tl.zeros((BLOCK_V,), dtype=tl.float32)

    # 2. Walk the shared dimension. Out-of-range rows and columns load as 0: they add nothing to
    #    a dot product or a norm, and their results are never stored.
    for d0 in range(0, D, BLOCK_D):
        d_ok = d0 + rd < D
        a = tl.load(a_ptr + rq[:, None] * stride_aq + (d0 + rd)[None, :], mask=q_ok[:, None] & d_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rv[:, None] * stride_bv + (d0 + rd)[None, :], mask=v_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:  # bfloat16 in Triton's CPU interpreter: numpy has no bf16 matmul, use float32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        dots = tl.dot(a, tl.trans(b), dots, input_precision=DOT_PRECISION)
        af = a.to(tl.float32)
        bf = b.to(tl.float32)
        a_sq += tl.sum(af * af, axis=1)
        b_sq += tl.sum(bf * bf, axis=1)

    # 3. Normalise: divide by the clamped norms of the row and the column.
    a_norm = tl.maximum(tl.sqrt(a_sq), eps)
    b_norm = tl.maximum(tl.sqrt(b_sq), eps)
    cos = dots / a_norm[:, None] / b_norm[None, :]

    # 4. Store the tile, masked at the ragged edges of the output.
    out_ptrs = out_ptr + rq[:, None] * stride_oq + rv[None, :]
    tl.store(out_ptrs, cos.to(out_ptr.dtype.element_ty), mask=q_ok[:, None] & v_ok[None, :])


def default_blocks(q: int, v: int, d: int) -> tuple[int, int, int]:
    """``(BLOCK_Q, BLOCK_V, BLOCK_D)`` for a Q x V x D problem.

    ``tl.dot`` needs every tile dimension to be at least 16. On a GPU, 64 x 64 tiles with 64-wide
    chunks keep a tile's operands in registers and shared memory. In the interpreter every program
    and every operation costs Python overhead, so few, very wide tiles run fastest: 8 queries
    against SmolLM2's 49152 x 576 table take about 3 s with 8192-row tiles, 25 s with 512-row ones.
    """
    block_d = max(16, min(64, triton.next_power_of_2(d)))
    block_q = max(16, min(64, triton.next_power_of_2(q)))
    block_v = max(16, min(8192 if runtime.interpreting() else 64, triton.next_power_of_2(v)))
    return block_q, block_v, block_d


def cosine_similarity(
    a: torch.Tensor,
    b: torch.Tensor,
    eps: float = DEFAULT_EPS,
    *,
    block_q: int | None = None,
    block_v: int | None = None,
    block_d: int | None = None,
) -> torch.Tensor:
    """The (Q, V) matrix of cosine similarities between the rows of ``a`` (Q, D) and ``b`` (V, D).

    Both must be 2-D, of one floating dtype (float32, float16, bfloat16), on the kernel device, and
    contiguous along D. The result has ``a``'s dtype; the kernel accumulates in float32. Float32
    inputs are multiplied in full IEEE precision on the GPU (not TF32), so the result agrees with
    ``F.cosine_similarity`` to float32 rounding. Block sizes are powers of two, at least 16.
    """
    require_tensor("a", a, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("b", b, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_same_dtype(a=a, b=b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a and b must have the same row length D, got {a.shape[1]} and {b.shape[1]}")
    if a.device != b.device:
        raise ValueError(f"b is on {b.device} but a is on {a.device}; they must match")
    require_positive("eps", eps)
    (q, d), v = a.shape, b.shape[0]
    bq, bv, bd = default_blocks(q, v, d)
    block_q, block_v, block_d = block_q or bq, block_v or bv, block_d or bd
    for name, blk in (("block_q", block_q), ("block_v", block_v), ("block_d", block_d)):
        require_power_of_two(name, blk)
        if blk < 16:
            raise ValueError(f"{name} must be at least 16 (tl.dot's smallest tile), got {blk}")
    out = torch.empty((q, v), dtype=a.dtype, device=a.device)
    if q == 0 or v == 0:
        return out
    if d == 0:
        return out.zero_()  # every vector is the zero vector: similarity 0 by the eps convention
    grid = (triton.cdiv(q, block_q), triton.cdiv(v, block_v))
    _cosine_kernel[grid](
        a, b, out, q, v, d,
        a.stride(0), b.stride(0), out.stride(0),
        float(eps),
        BLOCK_Q=block_q, BLOCK_V=block_v, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=runtime.interpreting() and a.dtype == torch.bfloat16,
    )
    return out


def top_k_neighbours(
    queries: torch.Tensor,
    table: torch.Tensor,
    k: int,
    exclude: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` table rows most cosine-similar to each query: ``(scores, indices)``, each (Q, k).

    Similarities come from the Triton kernel :func:`cosine_similarity`; the selection is
    ``torch.topk`` (sorted, most similar first; scores in float32). ``exclude`` (shape (Q,), optional)
    names one table row per query to leave out, usually the query's own id. Raises ``ValueError``
    when ``k`` exceeds the number of candidate rows.
    """
    require_tensor("table", table, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    _check_k(k, table.shape[0], exclude is not None)
    return top_k_of(cosine_similarity(queries, table, eps), k, exclude)
