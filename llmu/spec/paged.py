"""The target of speculative decoding over module 09's paged KV cache.

:class:`PagedTarget` keeps the target's keys and values in a :class:`~llmu.paged.PagedKVCache` pool,
one sequence in it, with a :class:`~llmu.paged.BlockManager` doing the bookkeeping. It answers what
the loop of ``llmu.spec.decode`` asks of a target cache, like ``ContiguousTarget`` does over one
contiguous ``KVCache``:

- ``length``: the positions the sequence holds;
- ``forward(ids)``: make room for ``len(ids)`` more positions (``BlockManager.prepare_write``: a
  new block each time the sequence crosses a block boundary), run the model over ``ids`` as a
  one-sequence paged batch, and return the logits of every one of them, ``(len(ids), V)``;
- ``crop(n)``: forget every position from ``n`` on (``BlockManager.truncate``). The rejected
  proposals' blocks go back to the free list at once; a contiguous cache would only move its end.

A server verifying the proposals of many requests does the same with one block table per request,
all in one forward pass (module 16's engine packs them so).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmu.paged.block_manager import BlockManager
from llmu.paged.cache import IMPLS, PagedKVCache
from llmu.paged.reference import slot_mapping

__all__ = ["PagedTarget"]


class PagedTarget:
    """The target model over a pool of ``block_size``-position blocks, holding one sequence.

    ``max_len``: the positions the sequence may reach (prompt, output and the proposals of one step
    on top). The pool has ``num_blocks`` blocks, by default exactly the ``ceil(max_len / block_size)``
    the sequence can fill. ``impl``: the paged attention (``llmu.paged.cache.IMPLS``; ``None`` picks
    Triton on a GPU, PyTorch on a CPU).

    ``blocks`` is the :class:`BlockManager` (``blocks.table(seq_id)``, ``blocks.num_free_blocks``) and
    ``pool`` the :class:`PagedKVCache`. Prefix caching is off: one sequence has nobody to share
    blocks with, so every block stays private and writable, and no write ever needs a copy.
    """

    seq_id = 0  # the name of the one sequence in the block manager

    def __init__(self, model, max_len: int, *, block_size: int = 16, num_blocks: int | None = None,
                 impl: str | None = None):
        if not hasattr(model, "config") or not hasattr(model, "embed_tokens"):
            raise TypeError(f"model must be a llmu Llama model, got {type(model).__name__}")
        for name, value in (("max_len", max_len), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        need = -(-max_len // block_size)
        if num_blocks is None:
            num_blocks = need
        elif isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < need:
            raise ValueError(f"num_blocks must be an int >= {need} (max_len={max_len} positions in blocks of "
                             f"{block_size}), got {num_blocks!r}")
        if impl is not None and impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
        self.model, self.max_len, self.impl = model, max_len, impl
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=False)
        self.pool = PagedKVCache.for_model(model, num_blocks=num_blocks, block_size=block_size)
        self._length = 0

    @property
    def length(self) -> int:
        """Positions the sequence holds."""
        return self._length

    @property
    def table(self) -> list[int]:
        """The sequence's block table (a copy; empty before the first forward pass)."""
        return self.blocks.table(self.seq_id) if self.seq_id in self.blocks.tables else []

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on; the blocks past them go back to the free list."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._length:
            raise ValueError(f"length must be an int in 0..{self._length}, got {length!r}")
        if self.seq_id in self.blocks.tables:
            self.blocks.truncate(self.seq_id, length)
        self._length = length

    @torch.no_grad()
    def forward(self, ids: Sequence[int]) -> torch.Tensor:
        """Append the keys and values of ``ids`` after the held positions; their logits, ``(len(ids), V)``."""
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("ids must hold at least one token")
        start, end = self._length, self._length + len(ids)
        if end > self.max_len:
            raise ValueError(f"the target holds max_len={self.max_len} positions; cannot add {len(ids)} after {start}")
        bm, bs = self.blocks, self.blocks.block_size
        if self.seq_id not in bm.tables:
            bm.allocate(self.seq_id, ids)
        self.pool.copy_blocks(bm.prepare_write(self.seq_id, start, end))  # copy-on-write (never, here) first
        table = bm.table(self.seq_id)
        batch = self.pool.batch([table], [end], [0, len(ids)], slot_mapping(table, start, end, bs), impl=self.impl)
        x = torch.tensor([ids], device=self.model.device)
        logits = self.model(x, positions=torch.arange(start, end, device=self.model.device), cache=batch).logits[0]
        self._length = end
        return logits

    def __repr__(self) -> str:
        return (f"PagedTarget(length={self._length}/{self.max_len}, table={self.table}, "
                f"free={self.blocks.num_free_blocks}/{self.blocks.num_blocks} blocks of {self.blocks.block_size})")
