"""PyTorch references of module 09: a KV cache kept in fixed-size blocks, and attention through it.

A contiguous cache (module 06) gives every sequence one ``(Hkv, max_len, D)`` slab, sized for the
longest the sequence could ever get. Most of it stays empty: a request that stops after 40 tokens
has reserved 2048. A *paged* cache keeps one shared pool of small blocks instead::

    k_cache, v_cache: (num_blocks, block_size, Hkv, D)      one pair per layer

and each sequence owns a *block table*, the list of physical blocks that hold its positions in
order. Position ``p`` of a sequence lives in block ``table[p // block_size]`` at offset
``p % block_size``; its *slot* (the row of the pool flattened to ``(num_blocks * block_size, Hkv,
D)``) is ``table[p // block_size] * block_size + p % block_size``. A sequence grows by one block
at a time, so at most ``block_size - 1`` positions per sequence are ever allocated and unused.

The functions here are the specification the Triton kernels of ``llmu.paged.kernels`` match:

- :func:`slot_mapping`: the slots of a run of positions, from a block table;
- :func:`write_kv`: store new keys and values at their slots;
- :func:`gather_kv`: read a sequence's keys and values back in position order (a copy);
- :func:`paged_decode_attention`: one query token per sequence against its paged context;
- :func:`paged_prefill_attention`: a packed batch of query *chunks* (several tokens per sequence,
  causal, after a cached prefix) against their paged contexts — what prefill and chunked prefill run;
- :func:`to_paged`: copy contiguous ``(B, Hkv, T, D)`` keys/values into a pool at given (for
  tests: shuffled) blocks.
"""

from __future__ import annotations

import math

import torch

from llmu.attention.reference import causal_mask
from llmu.checks import FLOAT_DTYPES, require_tensor

__all__ = [
    "slot_mapping", "write_kv", "gather_kv", "paged_decode_attention", "paged_prefill_attention",
    "to_paged", "check_paged_cache", "check_block_tables", "check_query", "check_cu_seqlens",
]

INDEX_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------------
# Checks shared by the reference and the kernels
# ----------------------------------------------------------------------------------------------


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, *, device=None) -> tuple[int, int, int, int]:
    """Check a pool pair ``(num_blocks, block_size, Hkv, D)``; return those four sizes.

    ``device="kernel"`` (what the Triton launchers pass) also asks for the device kernels run on.
    """
    require_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=True)
    require_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=True)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape (num_blocks, block_size, kv_heads, "
                         f"head_dim), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.device != v_cache.device:
        raise ValueError(f"k_cache is on {k_cache.device} but v_cache is on {v_cache.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (a pool is addressed as num_blocks * block_size rows)")
    if 0 in k_cache.shape:
        raise ValueError(f"k_cache must not be empty, got shape {tuple(k_cache.shape)}")
    return tuple(k_cache.shape)


def check_block_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                       num_blocks: int, batch: int | None = None, *, device=None) -> None:
    """``block_tables`` ``(B, max_blocks)`` and ``context_lens`` ``(B,)`` integer tensors on one device.

    Every sequence needs at least one position, and its table must have room for its length.
    Entries of the tables that a sequence's length does not reach are never read (any value, -1
    by convention); the ones it reaches must be valid block ids (checked here, on the host).
    """
    require_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    require_tensor("context_lens", context_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    b = block_tables.shape[0]
    if context_lens.shape[0] != b:
        raise ValueError(f"context_lens has {context_lens.shape[0]} entries but block_tables has {b} rows")
    if batch is not None and b != batch:
        raise ValueError(f"block_tables has {b} rows but the queries belong to {batch} sequences")
    if block_tables.device != context_lens.device:
        raise ValueError(f"block_tables is on {block_tables.device} but context_lens is on {context_lens.device}")
    if b == 0:
        return
    lens = context_lens.to("cpu", torch.int64)
    if int(lens.min()) < 1:
        raise ValueError(f"context_lens must all be >= 1 (a query attends to at least itself), got {lens.tolist()}")
    need = (lens + block_size - 1) // block_size
    if int(need.max()) > block_tables.shape[1]:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns but a context of {int(lens.max())} "
                         f"positions needs {int(need.max())} blocks of {block_size}")
    tables = block_tables.to("cpu", torch.int64)
    used = torch.arange(tables.shape[1], device="cpu")[None, :] < need[:, None]
    ids = tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables: the blocks the contexts use must be in 0..{num_blocks - 1}, got ids "
                         f"from {int(ids.min())} to {int(ids.max())}")


def check_query(q: torch.Tensor, k_cache: torch.Tensor, *, device=None) -> int:
    """Check packed queries ``q`` ``(rows, H, D)`` against the pool; return ``H``.

    One dtype and device with the cache, the cache's head_dim, and ``H`` a positive multiple of its
    KV heads (query head ``h`` reads KV head ``h // (H // Hkv)``).
    """
    require_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=device is not None)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if q.device != k_cache.device:
        raise ValueError(f"q is on {q.device} but k_cache is on {k_cache.device}")
    if q.dtype != k_cache.dtype:
        raise TypeError(f"q has dtype {q.dtype} but the cache holds {k_cache.dtype}; they must match")
    h = q.shape[1]
    if q.shape[2] != d:
        raise ValueError(f"q has head_dim {q.shape[2]} but the cache has {d}")
    if h == 0 or h % hkv:
        raise ValueError(f"q has {h} heads, which must be a positive multiple of the cache's {hkv} KV heads")
    return h


def check_cu_seqlens(cu_seqlens_q: torch.Tensor, num_rows: int, context_lens: torch.Tensor, *,
                     device=None) -> torch.Tensor:
    """``cu_seqlens_q`` ``(B + 1,)`` rises strictly from 0 to ``num_rows`` and no chunk is longer than
    its context. Returns the chunk lengths ``(B,)`` (int64, on the host)."""
    require_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if cu_seqlens_q.shape[0] == 0:
        raise ValueError("cu_seqlens_q must have B + 1 entries (it starts at 0), got an empty tensor")
    cu = cu_seqlens_q.to("cpu", torch.int64)
    q_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != num_rows or (q_lens < 1).any():
        raise ValueError(f"cu_seqlens_q must rise strictly from 0 to the number of query rows ({num_rows}), "
                         f"got {cu.tolist()}")
    lens = context_lens.to("cpu", torch.int64)
    if lens.shape == q_lens.shape and (q_lens > lens).any():
        raise ValueError(f"a sequence cannot have more new tokens than positions: q_lens {q_lens.tolist()}, "
                         f"context_lens {lens.tolist()}")
    return q_lens


# ----------------------------------------------------------------------------------------------
# Addresses: from positions to slots
# ----------------------------------------------------------------------------------------------


def slot_mapping(block_table, start: int, end: int, block_size: int) -> torch.Tensor:
    """Slots of positions ``start .. end - 1`` of the sequence whose blocks are ``block_table``.

    ``slot = block_table[p // block_size] * block_size + p % block_size`` (int64, ``(end - start,)``).
    """
    # a list of block ids becomes a CPU tensor; a tensor stays where it is
    device = block_table.device if isinstance(block_table, torch.Tensor) else "cpu"
    table = torch.as_tensor(block_table, dtype=torch.int64, device=device)
    if not 0 <= start <= end <= table.numel() * block_size:
        raise ValueError(f"positions {start}..{end - 1} do not fit a table of {table.numel()} blocks of {block_size}")
    p = torch.arange(start, end, device=table.device)
    return table[p // block_size] * block_size + p % block_size


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store ``k``, ``v`` (``(N, Hkv, D)``: N tokens) at pool rows ``slots`` (``(N,)``), in place."""
    nb, bs, hkv, d = check_paged_cache(k_cache, v_cache)
    for name, t in (("k", k), ("v", v)):
        require_tensor(name, t, ndim=3, dtypes=FLOAT_DTYPES, device=None)
        if tuple(t.shape[1:]) != (hkv, d):
            raise ValueError(f"{name} must be (tokens, kv_heads={hkv}, head_dim={d}), got {tuple(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but the cache holds {k_cache.dtype}")
    require_tensor("slots", slots, ndim=1, dtypes=INDEX_DTYPES, device=None)
    if slots.shape[0] != k.shape[0] or v.shape[0] != k.shape[0]:
        raise ValueError(f"slots ({slots.shape[0]}), k ({k.shape[0]}) and v ({v.shape[0]}) must count the same tokens")
    k_cache.view(nb * bs, hkv, d).index_copy_(0, slots.to(k_cache.device, torch.int64), k)
    v_cache.view(nb * bs, hkv, d).index_copy_(0, slots.to(v_cache.device, torch.int64), v)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table, length: int):
    """One sequence's keys and values in position order: two ``(Hkv, length, D)`` tensors (copies).

    This is the "block-table lookup": position ``p`` is row ``p % block_size`` of block
    ``block_table[p // block_size]``.
    """
    nb, bs, hkv, d = check_paged_cache(k_cache, v_cache)
    slots = slot_mapping(torch.as_tensor(block_table, device="cpu"), 0, length, bs).to(k_cache.device)
    k = k_cache.view(nb * bs, hkv, d)[slots].transpose(0, 1)
    v = v_cache.view(nb * bs, hkv, d)[slots].transpose(0, 1)
    return k, v


# ----------------------------------------------------------------------------------------------
# Attention through the block table
# ----------------------------------------------------------------------------------------------


def _attend(q, k, v, scale):
    """Float32 attention of ``q`` ``(H, Tq, D)`` (the last Tq positions) on ``k``/``v`` ``(Hkv, Tk, D)``."""
    h, tq, _ = q.shape
    hkv, tk, _ = k.shape
    g = h // hkv
    k = k.float().repeat_interleave(g, dim=0)
    v = v.float().repeat_interleave(g, dim=0)
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    if tq > 1:
        scores = scores.masked_fill(~causal_mask(tq, tk, device=q.device), float("-inf"))
    return scores.softmax(dim=-1) @ v


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                           scale: float | None = None) -> torch.Tensor:
    """Attention of one new token per sequence against its paged context.

    ``q`` ``(B, H, D)``; ``k_cache``/``v_cache`` ``(num_blocks, block_size, Hkv, D)`` already holding
    every position, the new one included; ``block_tables`` ``(B, max_blocks)``; ``context_lens``
    ``(B,)``: sequence ``b`` attends to its positions ``0 .. context_lens[b] - 1``. Query head ``h``
    reads KV head ``h // (H // Hkv)``. Returns ``(B, H, D)`` in ``q``'s dtype (float32 math).
    """
    nb, bs, hkv, d = check_paged_cache(k_cache, v_cache)
    check_query(q, k_cache)
    b = q.shape[0]
    check_block_tables(block_tables, context_lens, bs, nb, batch=b)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    lens = context_lens.tolist()
    for i in range(b):
        k, v = gather_kv(k_cache, v_cache, block_tables[i].cpu(), int(lens[i]))
        out[i] = _attend(q[i][:, None], k, v, scale)[:, 0].to(q.dtype)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            *, scale: float | None = None) -> torch.Tensor:
    """Causal attention of a packed batch of query chunks against their paged contexts.

    ``q`` ``(N, H, D)`` holds the new tokens of all ``B`` sequences one after another: sequence
    ``i``'s are rows ``cu_seqlens_q[i] .. cu_seqlens_q[i+1] - 1`` (``cu_seqlens_q`` ``(B + 1,)``,
    starting at 0, ending at ``N``). They are the *last* ``q_len_i`` of its ``context_lens[i]``
    positions (everything before was computed by earlier steps: a cached prefix, or the earlier
    chunks of a chunked prefill), and the cache already holds the keys and values of all of them.
    Query ``j`` of the chunk sits at position ``context_lens[i] - q_len_i + j`` and sees the
    positions up to its own. A decode step is the case ``q_len_i = 1`` for every sequence.
    Returns ``(N, H, D)`` in ``q``'s dtype.
    """
    nb, bs, hkv, d = check_paged_cache(k_cache, v_cache)
    check_query(q, k_cache)
    n = q.shape[0]
    check_cu_seqlens(cu_seqlens_q, n, context_lens)
    b = cu_seqlens_q.shape[0] - 1
    check_block_tables(block_tables, context_lens, bs, nb, batch=b)
    cu = cu_seqlens_q.to("cpu", torch.int64)
    lens = context_lens.to("cpu", torch.int64)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    for i in range(b):
        s, e = int(cu[i]), int(cu[i + 1])
        k, v = gather_kv(k_cache, v_cache, block_tables[i].cpu(), int(lens[i]))
        out[s:e] = _attend(q[s:e].transpose(0, 1), k, v, scale).transpose(0, 1).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Test helper: a contiguous cache copied into (shuffled) blocks
# ----------------------------------------------------------------------------------------------


def to_paged(k: torch.Tensor, v: torch.Tensor, lengths, *, block_size: int = 16, num_blocks: int | None = None,
             shuffle: bool = True, seed: int = 0):
    """Copy contiguous ``k``, ``v`` (``(B, Hkv, T, D)``) into a fresh pool; sequence ``b`` keeps its
    first ``lengths[b]`` positions.

    Returns ``(k_cache, v_cache, block_tables, context_lens)``. With ``shuffle`` the physical
    blocks are a random permutation of the pool (spare blocks included), so a kernel that ignored
    the table and read blocks in order would be caught. Unused table entries are -1; the pool's
    unused rows hold nan, so reading one shows up in the result.
    """
    require_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES, device=None)
    if v.shape != k.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, hkv, t, d = k.shape
    lengths = [int(x) for x in lengths]
    if len(lengths) != b or any(not 1 <= x <= t for x in lengths):
        raise ValueError(f"lengths must give 1..{t} positions for each of the {b} sequences, got {lengths}")
    per_seq = [(x + block_size - 1) // block_size for x in lengths]
    total = sum(per_seq)
    num_blocks = num_blocks if num_blocks is not None else total + 3
    if num_blocks < total:
        raise ValueError(f"num_blocks ({num_blocks}) is fewer than the {total} blocks these lengths need")
    g = torch.Generator(device="cpu").manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g, device="cpu") if shuffle else torch.arange(num_blocks, device="cpu")
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=k.dtype, device=k.device)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.full((b, max(per_seq)), -1, dtype=torch.int32, device="cpu")
    nxt = 0
    for i in range(b):
        tables[i, : per_seq[i]] = order[nxt : nxt + per_seq[i]].to(torch.int32)
        nxt += per_seq[i]
        slots = slot_mapping(tables[i, : per_seq[i]], 0, lengths[i], block_size).to(k.device)
        write_kv(k_cache, v_cache, k[i, :, : lengths[i]].transpose(0, 1), v[i, :, : lengths[i]].transpose(0, 1), slots)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cpu")
    return k_cache, v_cache, tables.to(k.device), lens.to(k.device)
