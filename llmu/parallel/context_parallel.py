"""Context parallelism: ring attention, one long sequence split over ``W`` processes.

Every other layer of a transformer treats tokens independently, so a sequence too long for one
device can simply be cut into ``W`` shards, one per rank. Attention is the exception: every query
needs every key. *Ring attention* (Liu, Zaharia and Abbeel, 2023) keeps each rank's **queries**
at home and sends the **keys and values** around a ring instead:

1. rank ``r`` holds the ``q``, ``k``, ``v`` of its own shard of the sequence;
2. for ``W`` steps: attend with the K/V block it holds now, and meanwhile (``isend``/``irecv``)
   pass that block to rank ``r + 1`` and receive the next one from rank ``r - 1``; after ``W``
   steps every query has seen every key, and each rank has sent ``W - 1`` K/V blocks;
3. merge the ``W`` partial results exactly as FlashAttention merges its tiles. A partial result
   over a block of keys is its normalised output ``o_i`` and the log of its softmax denominator
   ``lse_i`` (``llmu.flash.reference.flash_attention`` returns both). Two of them combine as::

       lse = logaddexp(lse_1, lse_2)
       o   = exp(lse_1 - lse) * o_1 + exp(lse_2 - lse) * o_2

   which is exact: it is the online softmax of module 08, with ``lse`` in place of ``(m, l)``.

No rank ever holds more than two K/V blocks (the one it uses and the one arriving), so the memory
for keys and values is ``O(T / W)``, and the transfer of the next block hides behind the
attention on the current one when compute takes longer than communication.

**Causal masking by blocks.** With the sequence cut into chunks, a (query chunk, key chunk) pair
is either entirely in the past (full attention, no mask), the diagonal (the usual causal mask),
or entirely in the future (skipped: no work at all). With the *contiguous* layout (rank ``r``
holds chunk ``r``) rank 0 does one half-tile of work and rank ``W-1`` does ``W - 1/2`` tiles:
the ring is as slow as its busiest rank. The *zigzag* layout (load-balanced, used by Llama 3's
context parallelism and ring-flash-attention) cuts the sequence into ``2W`` chunks and gives rank
``r`` chunks ``r`` and ``2W - 1 - r``: one early, one late, so every rank does the same ``2W``
half-size tiles of work. :func:`ring_schedule` tabulates both.

**Backward** (:class:`RingAttention`'s ``backward``): given the final ``o`` and ``lse`` of each
query, the gradient through one key block needs only that block (``P = exp(S - lse)`` is the
*global* softmax, restricted to it): ``llmu.flash.reference.attention_backward`` computes it.
The ring turns once more: ``k``, ``v`` travel as in the forward pass, and with them two
accumulators ``dk``, ``dv`` to which every rank adds its queries' contribution; after ``W``
steps (``W`` sends, one more than the forward) each block's gradient arrives back at its owner.

Functions: :func:`sequence_chunks`, :func:`shard_sequence`, :func:`unshard_sequence`,
:func:`local_positions` (how the sequence is laid out), :func:`ring_schedule` (who holds what,
and does what, at each step), :func:`merge_partials` (the merge), :func:`ring_attention` (the
distributed attention, forward and backward), :func:`demo` (for the notebook).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from llmu.checks import FLOAT_DTYPES, require_same_device, require_same_dtype, require_tensor
from llmu.flash.reference import attention_backward, flash_attention
from llmu.parallel.tensor_parallel import count_communication, record_collective

__all__ = ["LAYOUTS", "sequence_chunks", "shard_sequence", "unshard_sequence", "local_positions", "ring_schedule",
           "schedule_work", "merge_partials", "RingAttention", "ring_attention", "demo"]

#: How the sequence is cut: ``"contiguous"`` (``W`` chunks, rank ``r`` holds chunk ``r``) or
#: ``"zigzag"`` (``2W`` chunks, rank ``r`` holds chunks ``r`` and ``2W - 1 - r``: causal-balanced).
LAYOUTS = ("contiguous", "zigzag")


# ----------------------------------------------------------------------------------------------
# The layout of the sequence
# ----------------------------------------------------------------------------------------------


def _check_world(world_size, rank=None) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def sequence_chunks(world_size: int, rank: int, layout: str = "contiguous") -> list[int]:
    """The chunks of the sequence rank ``rank`` holds, in the order it stores them."""
    _check_world(world_size, rank)
    _check_layout(layout)
    return [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]


def _num_chunks(world_size: int, layout: str) -> int:
    return world_size if layout == "contiguous" else 2 * world_size


def _chunk_len(seq_len: int, world_size: int, layout: str) -> int:
    """The length of one chunk, refusing a sequence that does not cut evenly."""
    n = _num_chunks(world_size, layout)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if seq_len % n:
        raise ValueError(f"seq_len={seq_len} is not divisible by {n} (the number of chunks of the {layout!r} "
                         f"layout over world_size={world_size}): pad the sequence to a multiple of {n}")
    return seq_len // n


def shard_sequence(x: torch.Tensor, world_size: int, rank: int, *, layout: str = "contiguous",
                   dim: int = 2) -> torch.Tensor:
    """This rank's share of ``x`` along the sequence dimension ``dim`` (``2`` for ``(B, H, T, D)``).

    Refuses a length that ``W`` (contiguous) or ``2W`` (zigzag) does not divide."""
    chunk = _chunk_len(x.shape[dim], world_size, layout)
    pieces = [x.narrow(dim, c * chunk, chunk) for c in sequence_chunks(world_size, rank, layout)]
    return torch.cat(pieces, dim=dim).contiguous()


def unshard_sequence(shards: list[torch.Tensor], *, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The whole sequence from the ranks' shards (in rank order): the inverse of :func:`shard_sequence`."""
    world = len(shards)
    _check_world(world)
    per_rank = len(sequence_chunks(world, 0, layout))
    chunk = _chunk_len(shards[0].shape[dim], 1, "contiguous") // per_rank
    by_chunk = {}
    for rank, shard in enumerate(shards):
        for slot, c in enumerate(sequence_chunks(world, rank, layout)):
            by_chunk[c] = shard.narrow(dim, slot * chunk, chunk)
    return torch.cat([by_chunk[c] for c in range(_num_chunks(world, layout))], dim=dim)


def local_positions(seq_len: int, world_size: int, rank: int, layout: str = "contiguous") -> torch.Tensor:
    """The positions (``int64``) of this rank's tokens, in its storage order: what RoPE needs."""
    return shard_sequence(torch.arange(seq_len)[None, None, :, None], world_size, rank, layout=layout).view(-1)


# ----------------------------------------------------------------------------------------------
# The schedule
# ----------------------------------------------------------------------------------------------


def ring_schedule(world_size: int, *, causal: bool = True, layout: str = "contiguous") -> list[list[dict]]:
    """Who holds which K/V block at each step of the ring, and what it computes with it.

    Returns ``schedule[rank][step]``, a dict with ``kv_rank`` (the rank whose keys and values
    this rank holds at that step: ``(rank - step) mod W``), ``kv_chunks`` (their chunks of the
    sequence) and ``tiles``: one ``(q_slot, kv_slot, kind)`` per pair of this rank's query chunk
    and the held key chunk (slots index the chunks as stored), ``kind`` being ``"full"`` (keys
    all in the past, or not causal), ``"causal"`` (the diagonal chunk) or ``"skip"`` (all in the
    future). :func:`ring_attention` follows it.
    """
    _check_world(world_size)
    _check_layout(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    schedule = []
    for rank in range(world_size):
        q_chunks = sequence_chunks(world_size, rank, layout)
        steps = []
        for step in range(world_size):
            kv_rank = (rank - step) % world_size
            kv_chunks = sequence_chunks(world_size, kv_rank, layout)
            tiles = []
            for q_slot, qc in enumerate(q_chunks):
                for kv_slot, kc in enumerate(kv_chunks):
                    kind = "full" if (not causal or kc < qc) else ("causal" if kc == qc else "skip")
                    tiles.append((q_slot, kv_slot, kind))
            steps.append({"kv_rank": kv_rank, "kv_chunks": kv_chunks, "tiles": tiles})
        schedule.append(steps)
    return schedule


def schedule_work(schedule: list[list[dict]]) -> list[list[float]]:
    """``work[rank][step]``: the attention scores a rank computes at each step, in units of one
    rank-by-rank block (``(T/W)^2`` scores), so that layouts compare: a full tile counts its
    size, a causal diagonal half of it, a skipped one nothing. A zigzag tile is a quarter block
    (its chunks are ``T/2W`` long)."""
    weight = {"full": 1.0, "causal": 0.5, "skip": 0.0}
    per_rank = len(schedule[0][0]["kv_chunks"])          # chunks per rank: 1 contiguous, 2 zigzag
    return [[sum(weight[kind] for _, _, kind in step["tiles"]) / per_rank ** 2 for step in steps]
            for steps in schedule]


# ----------------------------------------------------------------------------------------------
# The merge and the ring pass
# ----------------------------------------------------------------------------------------------


def merge_partials(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                   lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint sets of keys, from each one's ``(out, lse)``: FlashAttention's merge.

    ``out_i``: ``(..., T, D)`` normalised outputs, ``lse_i``: ``(..., T)`` log-sum-exps. A row whose
    ``lse_1`` is ``-inf`` (no keys yet) takes ``(out_2, lse_2)``. Computed in float32.
    """
    if out1.shape != out2.shape or lse1.shape != lse2.shape or out1.shape[:-1] != lse1.shape:
        raise ValueError(f"out1, out2 must be (..., T, D) and lse1, lse2 (..., T) of matching shapes, got "
                         f"{tuple(out1.shape)}, {tuple(out2.shape)}, {tuple(lse1.shape)}, {tuple(lse2.shape)}")
    lse1, lse2 = lse1.float(), lse2.float()
    lse = torch.logaddexp(lse1, lse2)
    out = torch.exp(lse1 - lse)[..., None] * out1.float() + torch.exp(lse2 - lse)[..., None] * out2.float()
    return out, lse


class _RingPass:
    """One turn of the ring for some tensors: ``isend`` to rank + 1, ``irecv`` from rank - 1.

    Started before the step's compute and waited for after it, so that the transfer overlaps the
    attention. The tensors being sent must not be modified until :meth:`wait` returns."""

    def __init__(self, tensors: list[torch.Tensor], phase: str, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        send_to, recv_from = peer((rank + 1) % world), peer((rank - 1) % world)
        self.received = [torch.empty_like(t) for t in tensors]
        ops = []
        for tag, (t, buf) in enumerate(zip(tensors, self.received)):
            ops.append(dist.P2POp(dist.irecv, buf, recv_from, group, tag))
            ops.append(dist.P2POp(dist.isend, t.contiguous(), send_to, group, tag))
            record_collective("send", phase, t)
        # one batch: NCCL would otherwise serialise a send behind a receive from the same peer (W = 2)
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


def _require_group(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("ring attention needs a process group: run it inside llmu.distributed.launch "
                           "(or after torch.distributed.init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_ring_inputs(q, k, v, causal, layout, group) -> None:
    """Shapes of this rank's call, and the same shapes on every rank (one small all-gather)."""
    # require_attention_inputs would ask for the kernel device; these tensors live where the group does
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, t, ndim=4, dtypes=FLOAT_DTYPES, device=None)
    require_same_dtype(q=q, k=k, v=v)
    require_same_device(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k must be (batch={q.shape[0]}, kv_heads, T/W, head_dim={q.shape[3]}), got {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads, which must be a multiple of the number of KV heads "
                         f"({k.shape[1]}) in k (grouped-query attention)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    _check_layout(layout)
    world, _ = _require_group(group)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must hold the same tokens (this rank's shard of one sequence): q has "
                         f"{q.shape[2]}, k has {k.shape[2]}")
    per_rank = len(sequence_chunks(world, 0, layout))
    if q.shape[2] % per_rank:
        raise ValueError(f"the {layout!r} layout stores {per_rank} chunks per rank: this rank's length "
                         f"{q.shape[2]} must be divisible by {per_rank} (shard with shard_sequence)")
    # (a check, not part of the algorithm: count_communication does not record it)
    mine = torch.tensor([*q.shape, *k.shape], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    if any(not torch.equal(other, mine) for other in everyone):
        shapes = [tuple(t.tolist()) for t in everyone]
        raise ValueError(f"every rank must hold a q, k of the same shape (a sequence length divisible by the "
                         f"number of chunks); got (q shape + k shape) per rank {shapes}")


# ----------------------------------------------------------------------------------------------
# Ring attention
# ----------------------------------------------------------------------------------------------


class RingAttention(torch.autograd.Function):
    """Ring attention, forward and backward (see the module docstring). Inputs are this rank's
    shard; use :func:`ring_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        plan = ring_schedule(world, causal=causal, layout=layout)[rank]
        chunk = q.shape[2] // len(sequence_chunks(world, rank, layout))
        rows = lambda slot: slice(slot * chunk, (slot + 1) * chunk)   # noqa: E731 - a slot's tokens

        qf = q.float()
        out = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        k_held, v_held = k.contiguous(), v.contiguous()
        for step, held in enumerate(plan):
            # start passing the held block on before computing with it: the transfer overlaps the math
            ring = _RingPass([k_held, v_held], "forward", group) if step < world - 1 else None
            for q_slot, kv_slot, kind in held["tiles"]:
                if kind == "skip":
                    continue
                qs, ks = rows(q_slot), rows(kv_slot)
                o_tile, lse_tile = flash_attention(qf[:, :, qs], k_held[:, :, ks], v_held[:, :, ks],
                                                   causal=kind == "causal", scale=scale)
                out[:, :, qs], lse[:, :, qs] = merge_partials(out[:, :, qs], lse[:, :, qs], o_tile, lse_tile)
            if ring is not None:
                k_held, v_held = ring.wait()

        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.layout, ctx.group = causal, scale, layout, group
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        plan = ring_schedule(world, causal=ctx.causal, layout=ctx.layout)[rank]
        chunk = q.shape[2] // len(sequence_chunks(world, rank, ctx.layout))
        rows = lambda slot: slice(slot * chunk, (slot + 1) * chunk)   # noqa: E731

        qf, d_out = q.float(), d_out.float()
        dq = torch.zeros_like(qf)
        k_held, v_held = k.contiguous(), v.contiguous()
        dk_held = torch.zeros(k.shape, dtype=torch.float32, device=k.device)   # travel with their block
        dv_held = torch.zeros_like(dk_held)
        for step, held in enumerate(plan):
            # k, v can leave now (they are only read); dk, dv only once this step has added to them
            kv_ring = _RingPass([k_held, v_held], "backward", group) if step < world - 1 else None
            for q_slot, kv_slot, kind in held["tiles"]:
                if kind == "skip":
                    continue
                qs, ks = rows(q_slot), rows(kv_slot)
                dq_t, dk_t, dv_t = attention_backward(qf[:, :, qs], k_held[:, :, ks].float(),
                                                      v_held[:, :, ks].float(), out[:, :, qs], lse[:, :, qs],
                                                      d_out[:, :, qs], causal=kind == "causal", scale=ctx.scale)
                dq[:, :, qs] += dq_t
                dk_held[:, :, ks] += dk_t
                dv_held[:, :, ks] += dv_t
            # W sends of the accumulators in all: after the last, each block's are back at its owner
            if world > 1:
                dk_held, dv_held = _RingPass([dk_held, dv_held], "backward", group).wait()
            if kv_ring is not None:
                k_held, v_held = kv_ring.wait()
        return dq.to(q.dtype), dk_held.to(k.dtype), dv_held.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   scale: float | None = None, layout: str = "contiguous", group=None):
    """Attention over a sequence split across the ranks of ``group``; returns ``(out, lse)``.

    Call it on every rank at once with that rank's shard (:func:`shard_sequence` with the same
    ``layout``): ``q`` ``(B, H, T/W, D)``, ``k``, ``v`` ``(B, Hkv, T/W, D)`` with ``H`` a multiple
    of ``Hkv`` (grouped-query attention: only the ``Hkv`` heads travel). ``out`` ``(B, H, T/W, D)``
    (``q``'s dtype) and ``lse`` ``(B, H, T/W)`` (float32) are this rank's rows of full attention
    over the whole sequence (``causal``: position ``i`` sees positions ``<= i``). Differentiable
    with respect to ``q``, ``k`` and ``v`` (the backward is a second turn of the ring).
    """
    _check_ring_inputs(q, k, v, causal, layout, group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return RingAttention.apply(q, k, v, causal, scale, layout, group)


# ----------------------------------------------------------------------------------------------
# For the notebook
# ----------------------------------------------------------------------------------------------


def demo(rank: int, world_size: int, seq_len: int = 64, batch: int = 1, heads: int = 4, kv_heads: int = 2,
         head_dim: int = 16, causal: bool = True, layout: str = "zigzag", seed: int = 0) -> dict:
    """Ring attention on this rank's shard, forward and backward, against full attention.

    Run it with ``llmu.distributed.launch(demo, 2)``. Every rank draws the same ``q``, ``k``,
    ``v`` and output gradient for the whole sequence from ``seed``, computes full attention
    (``llmu.attention.reference.attention``) and its gradients with autograd, then ring attention
    on its own shard. Returns a dict: the largest absolute differences ``out``, ``lse``, ``dq``,
    ``dk``, ``dv`` (this rank's rows), the ``schedule`` of this rank (per step: the rank whose K/V
    block it holds, its chunks, and the tiles computed or skipped), ``work`` per step
    (:func:`schedule_work`), ``seconds`` (the ring's forward plus backward on this rank), and the
    point-to-point traffic this rank sent: ``sends`` (tensors) and ``sent_bytes``, per phase.
    Forward: ``k`` and ``v``, ``W - 1`` times; backward: ``k``, ``v`` ``W - 1`` times and the
    float32 ``dk``, ``dv`` ``W`` times.
    """
    from llmu.attention.reference import attention

    g = torch.Generator().manual_seed(seed)
    q_all = torch.randn(batch, heads, seq_len, head_dim, generator=g)
    k_all = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g)
    v_all = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g)
    d_out_all = torch.randn(q_all.shape, generator=g)

    # full attention on the whole sequence, on every rank: the answer
    full = [t.clone().requires_grad_() for t in (q_all, k_all, v_all)]
    out_ref = attention(*full, causal=causal)
    (out_ref * d_out_all).sum().backward()
    _, lse_ref = flash_attention(q_all, k_all, v_all, causal=causal)

    # this rank's shard through the ring
    mine = lambda t: shard_sequence(t, world_size, rank, layout=layout)   # noqa: E731
    q, k, v = (mine(t).requires_grad_() for t in (q_all, k_all, v_all))
    start = time.perf_counter()
    with count_communication() as log:
        out, lse = ring_attention(q, k, v, causal=causal, layout=layout)
        (out * mine(d_out_all)).sum().backward()
    seconds = time.perf_counter() - start
    sends = {phase: [c.nbytes for c in log if c.op == "send" and c.phase == phase] for phase in ("forward", "backward")}

    err = lambda a, b: (a - mine(b)).abs().max().item()   # noqa: E731
    schedule = ring_schedule(world_size, causal=causal, layout=layout)
    return {
        "out": err(out, out_ref.detach()), "lse": (lse - mine(lse_ref[..., None])[..., 0]).abs().max().item(),
        "dq": err(q.grad, full[0].grad), "dk": err(k.grad, full[1].grad), "dv": err(v.grad, full[2].grad),
        "schedule": schedule[rank], "work": schedule_work(schedule)[rank], "seconds": seconds,
        "sends": {phase: len(sizes) for phase, sizes in sends.items()},
        "sent_bytes": {phase: sum(sizes) for phase, sizes in sends.items()},
    }
