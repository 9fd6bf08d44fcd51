"""FlashAttention in plain PyTorch: the tiled algorithm with the online softmax, written to be read.

Naive attention computes the whole ``(Tq, Tk)`` score matrix ``S = q k^T * scale``, its softmax
``P`` and then ``P v``. FlashAttention gives exactly the same output without ever holding more than
one ``(block_q, block_k)`` tile of ``S``: it walks over the keys and values block by block and
keeps, for every query row,

- ``m``: the largest score seen so far (the running maximum);
- ``l``: the sum of ``exp(score - m)`` over the keys seen so far (the running sum);
- ``acc``: the sum of ``exp(score - m) * v`` over the keys seen so far (the unnormalised output).

When a new block raises the maximum from ``m`` to ``m_new``, everything accumulated so far was
computed relative to the old maximum; multiplying ``l`` and ``acc`` by ``exp(m - m_new)`` puts them
relative to the new one. After the last block ``out = acc / l`` and the log of the softmax
denominator is ``lse = m + log(l)``: the backward pass recomputes ``P = exp(S - lse)`` from it
instead of storing ``P``. The extra memory is ``O(Tq)`` numbers per head (``m``/``l``, then
``lse``), not ``O(Tq·Tk)``.

Functions:

- :func:`online_softmax`: the softmax of each row of ``x`` in one streaming pass over column blocks
  for the statistics (the 1-D heart of the algorithm);
- :func:`flash_attention`: the tiled forward, returning ``(out, lse)``;
- :func:`attention_backward`: the backward formulas given ``(q, k, v, o, lse, do)``, on the
  whole ``(Tq, Tk)`` matrix at once;
- :func:`tiled_attention_backward`: the same gradients tile by tile, in FlashAttention-2's order
  (key blocks outside, query blocks inside: the order of the Triton backward's dK, dV kernel);
- :func:`naive_hbm_elements` / :func:`flash_hbm_elements`: memory-traffic counts of the two
  algorithms (the notebook plots them).
"""

from __future__ import annotations

import math

import torch

from llmu.attention.reference import repeat_kv

__all__ = [
    "online_softmax",
    "online_softmax_stats",
    "flash_attention",
    "attention_backward",
    "tiled_attention_backward",
    "naive_hbm_elements",
    "flash_hbm_elements",
]


def online_softmax_stats(x: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Running maximum ``m`` and running sum ``l = sum exp(x - m)`` of each row, one block at a time.

    ``x``: ``(..., N)``. Returns ``(m, l)`` of shape ``(...)``, float32, after all the blocks.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    x = x.float()
    m = torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=x.device)
    l = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[-1], block):
        xb = x[..., start:start + block]
        m_new = torch.maximum(m, xb.amax(dim=-1))
        # exp(m - m_new) rescales the old sum to the new maximum; -inf - (-inf) would be NaN, so a
        # row that is still all -inf keeps m_new = 0 as its reference.
        m_ref = torch.where(torch.isinf(m_new) & (m_new < 0), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - m_ref) + torch.exp(xb - m_ref[..., None]).sum(dim=-1)
        m = m_new
    return m, l


def online_softmax(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """``softmax(x, dim=-1)`` with the statistics gathered in one pass over column blocks."""
    m, l = online_softmax_stats(x, block)
    return (torch.exp(x.float() - m[..., None]) / l[..., None]).to(x.dtype)


def _check_qkv(q, k, v, causal):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D (batch, heads, seq, head_dim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, tq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k must be (batch={b}, kv_heads, kv_len, head_dim={d}), got {tuple(k.shape)}")
    if h % k.shape[1]:
        raise ValueError(f"the number of query heads ({h}) must be a multiple of the KV heads ({k.shape[1]})")
    if causal and tq > k.shape[2]:
        raise ValueError(f"causal attention needs q_len <= kv_len (queries are the last q_len positions), "
                         f"got q_len={tq}, kv_len={k.shape[2]}")


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled attention with the online softmax; returns ``(out, lse)``.

    ``q``: ``(B, H, Tq, D)``; ``k``, ``v``: ``(B, Hkv, Tk, D)`` with ``H`` a multiple of ``Hkv``
    (grouped-query attention). With ``causal``, the queries are the *last* ``Tq`` of the ``Tk``
    positions (bottom-right alignment, as in decoding with a cache): query ``i`` sees keys
    ``0 .. Tk - Tq + i``. ``out`` has ``q``'s dtype; ``lse`` is ``(B, H, Tq)`` float32, the natural
    log of each row's softmax denominator (``log sum_j exp(s_ij)``). Arithmetic is float32.
    """
    _check_qkv(q, k, v, causal)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q and block_k must be >= 1, got {block_q}, {block_k}")
    b, h, tq, d = q.shape
    tk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kf = repeat_kv(k.float(), h // k.shape[1])          # (B, H, Tk, D): each query head's keys
    vf = repeat_kv(v.float(), h // k.shape[1])
    qf = q.float()
    offset = tk - tq                                    # query i sits at position offset + i
    out = torch.empty(b, h, tq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, tq, dtype=torch.float32, device=q.device)

    for q0 in range(0, tq, block_q):                    # outer loop: one block of query rows
        qb = qf[:, :, q0:q0 + block_q]                  # (B, H, bq, D), stays "on chip"
        rows = torch.arange(q0, q0 + qb.shape[2], device=q.device)
        m = torch.full(qb.shape[:-1], float("-inf"), device=q.device)   # running max
        l = torch.zeros(qb.shape[:-1], device=q.device)                 # running sum
        acc = torch.zeros_like(qb)                                      # running sum of p @ v
        # causal: keys after the block's last query are invisible to all its rows; stop there
        k_end = min(tk, q0 + qb.shape[2] + offset) if causal else tk
        for k0 in range(0, k_end, block_k):             # inner loop: one block of keys and values
            kb, vb = kf[:, :, k0:k0 + block_k], vf[:, :, k0:k0 + block_k]
            s = (qb @ kb.transpose(-1, -2)) * scale     # (B, H, bq, bk): one tile of scores
            if causal:
                cols = torch.arange(k0, k0 + kb.shape[2], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None] + offset, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            # every row sees key 0 (causal or not), so m_new is finite from the first block on
            alpha = torch.exp(m - m_new)                # rescales what was summed under the old max
            p = torch.exp(s - m_new[..., None])         # this block's unnormalised probabilities
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ vb
            m = m_new
        out[:, :, q0:q0 + block_q] = acc / l[..., None]  # normalise once, at the end
        lse[:, :, q0:q0 + block_q] = m + torch.log(l)
    return out.to(q.dtype), lse


def attention_backward(q, k, v, o, lse, do, *, causal: bool = False, scale: float | None = None):
    """Gradients ``(dq, dk, dv)`` of attention from its saved ``(q, k, v, o, lse)`` and ``dO``.

    With ``S = q k^T * scale`` (masked), ``P = exp(S - lse)`` (recomputed, never stored):

        dV = P^T dO
        dP = dO V^T
        D  = rowsum(dO * O)          (= rowsum(P * dP): the softmax's Jacobian term)
        dS = P * (dP - D)
        dQ = dS K * scale,   dK = dS^T Q * scale

    For grouped-query attention the gradients of the query heads that share a KV head are summed.
    Computed densely here (float32); the Triton backward does the same one tile at a time.
    """
    _check_qkv(q, k, v, causal)
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    rep = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf, of, dof = q.float(), o.float(), do.float()
    kf, vf = repeat_kv(k.float(), rep), repeat_kv(v.float(), rep)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(tq, device=q.device)[:, None]
        j = torch.arange(tk, device=q.device)[None, :]
        s = s.masked_fill(j > i + tk - tq, float("-inf"))
    p = torch.exp(s - lse[..., None].float())
    dv = p.transpose(-1, -2) @ dof
    dp = dof @ vf.transpose(-1, -2)
    delta = (dof * of).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf) * scale
    # sum the query heads of each group into their KV head
    dk = dk.reshape(b, hkv, rep, tk, d).sum(dim=2)
    dv = dv.reshape(b, hkv, rep, tk, d).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def tiled_attention_backward(q, k, v, o, lse, do, *, causal: bool = False, scale: float | None = None,
                             block_q: int = 64, block_k: int = 64):
    """The gradients of :func:`attention_backward`, computed one ``(block_q, block_k)`` tile at a time.

    FlashAttention-2's order: the outer loop walks over blocks of keys, and for each keeps ``dK`` and
    ``dV`` of its block in an accumulator (on a GPU: the registers of one program); the inner loop
    walks over the blocks of queries, recomputes the tile ``P = exp(S - lse)`` from the saved
    log-sum-exp, adds the tile's share to ``dK``, ``dV`` and to the rows of ``dQ`` it touches
    (``dQ`` accumulates across the outer loop: on a GPU an atomic add, or a second pass). ``D =
    rowsum(dO * O)`` is computed once, before the loops. Under the causal mask (bottom-right
    aligned: query ``i`` sees keys ``j <= i + Tk - Tq``) a query block whose last query sits
    before the key block's first key sees none of it and is skipped: nearly half the tiles when
    ``Tq = Tk``.

    Grouped-query attention: the query heads of a group are processed together, as one block of
    ``(Hq / Hkv) x block_q`` rows against their shared KV head, and their shares of ``dK``, ``dV``
    are summed over the group. The largest tensors it creates are the gradients themselves and a
    few ``(B, Hq, block_q, block_k)`` tiles: never the ``(Tq, Tk)`` matrix. Float32 arithmetic;
    gradients in the inputs' dtypes.
    """
    _check_qkv(q, k, v, causal)
    for name, val in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if tuple(o.shape) != tuple(q.shape) or tuple(do.shape) != tuple(q.shape) or tuple(lse.shape) != (b, h, tq):
        raise ValueError(f"o and do must have q's shape {tuple(q.shape)} and lse {(b, h, tq)}; got "
                         f"{tuple(o.shape)}, {tuple(do.shape)}, {tuple(lse.shape)}")
    g = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    offset = tk - tq                                     # query i sits at key position offset + i
    # (B, Hkv, G, T, D): the query heads of a group side by side, against their one KV head
    qf, dof = q.float().reshape(b, hkv, g, tq, d), do.float().reshape(b, hkv, g, tq, d)
    lsef = lse.float().reshape(b, hkv, g, tq)
    kf, vf = k.float(), v.float()
    delta = (dof * o.float().reshape(b, hkv, g, tq, d)).sum(dim=-1)    # D = rowsum(dO * O): (B, Hkv, G, Tq)
    dq = torch.zeros(b, hkv, g, tq, d, device=q.device)
    dk = torch.empty(b, hkv, tk, d, device=q.device)
    dv = torch.empty(b, hkv, tk, d, device=q.device)
    for k0 in range(0, tk, block_k):                     # outer loop: one block of keys and values
        kb = kf[:, :, None, k0:k0 + block_k]             # (B, Hkv, 1, bk, D), shared by the group
        vb = vf[:, :, None, k0:k0 + block_k]
        cols = torch.arange(k0, k0 + kb.shape[3], device=q.device)
        dk_acc = torch.zeros(b, hkv, g, kb.shape[3], d, device=q.device)   # this block's dK, dV
        dv_acc = torch.zeros_like(dk_acc)
        # causal: query rows i < k0 - offset see no key of this block; start at the block holding the first that does
        q_start = (max(0, k0 - offset) // block_q) * block_q if causal else 0
        for q0 in range(q_start, tq, block_q):          # inner loop: one block of queries
            sl = slice(q0, q0 + block_q)
            qb, dob = qf[:, :, :, sl], dof[:, :, :, sl]
            s = (qb @ kb.transpose(-1, -2)) * scale      # (B, Hkv, G, bq, bk): one tile of scores
            if causal:
                rows = torch.arange(q0, q0 + qb.shape[3], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None] + offset, float("-inf"))
            p = torch.exp(s - lsef[:, :, :, sl, None])   # recomputed from the lse; masked entries exp(-inf) = 0
            dv_acc += p.transpose(-1, -2) @ dob          # dV += P^T dO
            dp = dob @ vb.transpose(-1, -2)              # dP = dO V^T
            ds = p * (dp - delta[:, :, :, sl, None])     # dS = P * (dP - D)
            dk_acc += ds.transpose(-1, -2) @ qb          # dK += dS^T Q
            dq[:, :, :, sl] += ds @ kb                   # dQ += dS K (across the outer loop)
        dk[:, :, k0:k0 + block_k] = dk_acc.sum(dim=2) * scale   # the group's query heads summed
        dv[:, :, k0:k0 + block_k] = dv_acc.sum(dim=2)
    dq = (dq * scale).reshape(b, h, tq, d)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def naive_hbm_elements(n, d: int) -> float:
    """Elements naive attention moves to and from memory for one head, ``N`` queries and keys.

    Read q, k (2Nd); write S (N²); read S, write P (2N²); read P and v (N² + Nd); write o (Nd):
    ``4·N·d + 4·N²``. The N² terms dominate as soon as N > d.
    """
    return 4 * n * d + 4 * n * n


def flash_hbm_elements(n, d: int, block_q: int = 128) -> float:
    """Elements the tiled algorithm moves for one head: q once, k and v once per query block,
    o and the N log-sum-exps written once: ``N·d + 2·N·d·ceil(N / block_q) + N·d + N``.

    Still quadratic in N (every query block streams all keys), but divided by ``block_q / d``
    relative to the naive N² terms, and nothing N×N is ever written.
    """
    blocks = -(-n // block_q)
    return 2 * n * d + 2 * n * d * blocks + n


def _heads(q, k, v) -> bool:
    """True when ``q``, ``k``, ``v`` are 3-D ``(B, N, D)``, one head (then viewed as ``(B, 1, N, D)``);
    False when 4-D; otherwise a ValueError naming the shapes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dims = (q.dim(), k.dim(), v.dim())
    if dims == (3, 3, 3):
        return True
    if dims == (4, 4, 4):
        return False
    raise ValueError(f"q, k, v must all be 4-D (batch, heads, seq, head_dim) or all 3-D (batch, seq, head_dim), "
                     f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def _to_heads(q, k, v):
    """``((q, k, v), one_head)``: 3-D inputs viewed as one head ``(B, 1, N, D)``; 4-D as they are."""
    one_head = _heads(q, k, v)
    return ((q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)) if one_head else (q, k, v)), one_head


def _from_heads(one_head: bool, *tensors):
    """Undo :func:`_to_heads` on results (drop the head dimension of one-head inputs)."""
    return tuple(t.squeeze(1) for t in tensors) if one_head else tensors


def attention_function(name: str, forward, backward, doc: str) -> type[torch.autograd.Function]:
    """A differentiable attention ``name`` from a ``forward(q, k, v, causal, scale, block_a, block_b)
    -> (o, lse)`` and a ``backward(q, k, v, o, lse, do, causal, scale) -> (dq, dk, dv)`` on 4-D
    tensors: it accepts 3-D one-head input too, defaults everything after ``v``, and saves exactly
    ``(q, k, v, o, lse)``. The Triton kernels and this module's torch reference are both made so."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal=False, scale=None, block_a=None, block_b=None):
            (q, k, v), ctx.one_head = _to_heads(q, k, v)
            o, lse = forward(q, k, v, bool(causal), scale, block_a, block_b)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.causal, ctx.scale = bool(causal), scale
            ctx.mark_non_differentiable(lse)
            return _from_heads(ctx.one_head, o, lse)

        @staticmethod
        def backward(ctx, do, _dlse):
            q, k, v, o, lse = ctx.saved_tensors
            do = do.unsqueeze(1) if ctx.one_head else do
            grads = backward(q, k, v, o, lse, do, ctx.causal, ctx.scale)
            return (*_from_heads(ctx.one_head, *grads), None, None, None, None)

    Function.__name__ = Function.__qualname__ = name
    Function.__doc__ = doc
    return Function


FlashAttentionReference = attention_function(
    "FlashAttentionReference",
    lambda q, k, v, causal, scale, block_q, block_k: flash_attention(
        q, k, v, causal=causal, scale=scale, block_q=block_q or 64, block_k=block_k or 64),
    lambda q, k, v, o, lse, do, causal, scale: attention_backward(q, k, v, o, lse, do, causal=causal, scale=scale),
    """The torch reference as a differentiable function, paired as the Triton one is
    (:class:`llmu.flash.kernels.FlashAttentionFunction`): the forward is the tiled
    :func:`flash_attention`, the backward :func:`attention_backward`, and it saves exactly what
    the Triton one saves, ``(q, k, v, o, lse)``, never the ``N x N`` probabilities.

    ``FlashAttentionReference.apply(q, k, v, causal=False, scale=None, block_q=64, block_k=64)``;
    ``q``, ``k``, ``v`` 4-D ``(B, H, N, D)`` or 3-D ``(B, N, D)`` for one head. Returns ``(o, lse)``.
    """)
