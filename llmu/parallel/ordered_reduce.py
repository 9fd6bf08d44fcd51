"""Reductions whose sum is taken in rank order, so that sharded training is bit-exact.

Floating-point addition is not associative: ``(a + b) + c`` and ``a + (b + c)`` can differ in the
last bit. A collective that sums the ranks' gradients chooses its own order: a ring adds the chunks
in the order they travel round the ring, so chunk ``j`` is summed starting at rank ``j + 1``; a
tree adds pairs; NCCL picks per call. With two ranks the order does not matter (``a + b = b + a``
exactly), with three or more it does, and a parameter trained on 4 ranks drifts away from the
same model trained in one process by a few ulps per step.

The fix is to fix the order. A single process that accumulates the gradients of the same
micro-batches, one after the other (``loss.backward()`` per micro-batch adds into ``p.grad``),
computes ``((g0 + g1) + g2) + g3``. The functions below compute exactly that sum:

- :func:`reduce_scatter_in_rank_order`: an **all-to-all** gives each rank the ``W`` pieces of its
  own slice (piece ``i`` from rank ``i``); the rank adds them left to right, ``g0 + g1``, then
  ``+ g2``, and so on. Each rank sends and receives ``(W - 1)/W`` of the buffer, the same bytes as
  a ring reduce-scatter; the additions happen on the receiver, once, instead of along the ring.
- :func:`all_reduce_in_rank_order`: that reduce-scatter followed by an all-gather, which is how a
  ring all-reduce is built anyway (see :mod:`llmu.parallel.comm`), with the same traffic.

The cost is memory: the all-to-all's receive buffer is as large as the input (``W`` pieces of
``1/W``), where a ring needs one chunk. ZeRO (:class:`llmu.parallel.zero.ZeRO`) and
:class:`llmu.parallel.sharded_optimizer.ShardedOptimizer` use these by default
(``reduce_order="rank"``); ``reduce_order="collective"`` hands the sum to the backend's own
reduce-scatter and all-reduce (faster on a GPU for large buffers; last bits depend on the order
the backend picked).

What exactness needs besides the order: the same micro-batches on the same ranks, a per-rank
gradient computed by the same kernels as the reference's (same device, same thread count), and a
division by ``W`` that commutes with the sum. Dividing by a power of two is exact, so the mean of a
2-, 4- or 8-rank reduction equals the single process's gradient of ``loss / W`` accumulated over
the micro-batches; for other ``W`` both sides must divide the same way (the sum, then ``/ W``).
What no order can reproduce is one backward over the whole batch: its weight gradients are
matrix products whose inner sum runs over all the batch's tokens at once, blocked as the matrix
library chooses, not as a sum of per-micro-batch products.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["REDUCE_ORDERS", "check_reduce_order", "reduce_scatter_in_rank_order", "all_reduce_in_rank_order"]

#: ``"rank"``: sum in rank order (exact, these functions); ``"collective"``: the backend's own order.
REDUCE_ORDERS = ("rank", "collective")

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_reduce_order(reduce_order) -> str:
    """``reduce_order`` if it is one of :data:`REDUCE_ORDERS`, else ``ValueError`` naming it."""
    if not isinstance(reduce_order, str) or reduce_order not in REDUCE_ORDERS:
        raise ValueError(f"reduce_order must be one of {REDUCE_ORDERS} ('rank': summed in rank order, bit-exact "
                         f"against one process; 'collective': the backend's order), got {reduce_order!r}")
    return reduce_order


def _world(group) -> int:
    return dist.get_world_size(group)


def reduce_scatter_in_rank_order(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """``output`` (``n``,) ← this rank's slice of the sum over ranks of ``input`` (``W·n``,),
    summed as ``((x_0 + x_1) + x_2) + …`` in rank order. A collective: every rank calls it.

    Same contract as ``torch.distributed.reduce_scatter_tensor(output, input)`` with ``op=SUM``:
    rank ``r`` receives elements ``[r·n, (r+1)·n)`` of the sum. Returns ``output``."""
    world = _world(group)
    if input.ndim != 1 or output.ndim != 1:
        raise ValueError(f"input and output must be 1-D, got shapes {tuple(input.shape)} and {tuple(output.shape)}")
    if input.numel() != world * output.numel():
        raise ValueError(f"input must hold world_size x output.numel() = {world} x {output.numel()} elements, "
                         f"got {input.numel()}")
    if input.dtype != output.dtype:
        raise ValueError(f"input and output must have one dtype, got {input.dtype} and {output.dtype}")
    # 1. all-to-all: piece i of what I receive is rank i's values of my slice
    pieces = torch.empty_like(input)
    dist.all_to_all_single(pieces, input.contiguous(), group=group)
    pieces = pieces.view(world, -1)
    # 2. the sum, left to right: the order a single process accumulating micro-batches uses
    output.copy_(pieces[0])
    for i in range(1, world):
        output.add_(pieces[i])
    return output


def all_reduce_in_rank_order(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``tensor`` ← the sum over ranks of ``tensor``, in place, summed in rank order
    (:func:`reduce_scatter_in_rank_order`, then an all-gather). Any shape; the flat buffer is
    padded with zeros to a multiple of the world size for the exchange. Returns ``tensor``."""
    world = _world(group)
    n = tensor.numel()
    padded = -(-n // world) * world
    work = torch.cat([tensor.reshape(-1), tensor.new_zeros(padded - n)])
    mine = work.new_empty(padded // world)
    reduce_scatter_in_rank_order(mine, work, group)
    _all_gather(work, mine, group=group)          # every rank's finished slice, back in place
    tensor.copy_(work[:n].view_as(tensor))
    return tensor
