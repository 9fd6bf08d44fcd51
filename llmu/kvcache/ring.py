"""A sliding-window KV cache: a ring buffer of the last ``window`` positions of every sequence.

With sliding-window attention (Mistral 7B: 4,096 positions; Gemma 2 and 3 in their local layers)
a token attends to itself and the ``window - 1`` tokens before it, never further back. The cache
then only ever needs the last ``window`` keys and values of each sequence, so its memory stops
growing with the context: ``window`` slots per sequence, layer and KV head, however long the text.

The slots form a ring: the token at absolute position ``p`` goes to slot ``p % window``,
overwriting the token ``window`` positions before it, which has just left the window. The ring is
never reordered, and it need not be: RoPE has already rotated each key by its own position before
it was cached, so a key carries its position with it, and attention is a weighted *sum* over the
keys, which does not depend on the order in which they lie in memory. All a step needs to know is
how many slots hold a token: ``min(length, window)``.

:class:`RingKVCache` holds one layer's ring for a batch. ``append`` writes one token for the
sequences marked active (a serving batch has sequences that wait or have finished), ``attend`` is
module 06's decode attention (``reference.attend_cached``) over the filled slots. Memory:
``2 * batch * kv_heads * window * head_dim`` values, against ``... * context`` for a full cache.
"""

from __future__ import annotations

import torch

from llmu.checks import require_positive
from llmu.kvcache.reference import attend_cached

__all__ = ["RingKVCache"]


class RingKVCache:
    """The last ``window`` keys and values of ``batch`` sequences, for one layer (module docstring).

    ``k``, ``v``: ``(batch, kv_heads, window, head_dim)`` in ``dtype``; ``lengths`` ``(batch,)``
    int64: the tokens each sequence has appended in all (its next absolute position).
    """

    def __init__(self, batch: int, kv_heads: int, window: int, head_dim: int, dtype=torch.float32, device=None):
        for name, value in (("batch", batch), ("kv_heads", kv_heads), ("window", window), ("head_dim", head_dim)):
            require_positive(name, value, integer=True)
        shape = (batch, kv_heads, window, head_dim)
        self.window = window
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=device)

    def append(self, k: torch.Tensor, v: torch.Tensor, active: torch.Tensor | None = None) -> None:
        """Write one new token's key and value, ``(batch, kv_heads, 1, head_dim)`` each, into the
        ring of every sequence that ``active`` ``(batch,)`` bool marks (None: all of them)."""
        want = (*self.k.shape[:2], 1, self.k.shape[3])
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a tensor of shape (batch, kv_heads, 1, head_dim) = {want}, got {got}")
        if active is None:
            active = torch.ones_like(self.lengths, dtype=torch.bool)
        elif not isinstance(active, torch.Tensor) or active.dtype != torch.bool or tuple(active.shape) != (want[0],):
            raise ValueError(f"active must be a bool tensor of shape (batch,) = ({want[0]},), got {active!r}")
        rows = torch.nonzero(active).flatten()
        slots = self.lengths[rows] % self.window          # -- the oldest slot, once the ring is full
        self.k[rows, :, slots] = k[rows, :, 0].to(self.k.dtype)
        self.v[rows, :, slots] = v[rows, :, 0].to(self.v.dtype)
        self.lengths[rows] += 1

    def attend(self, q: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Decode attention of ``q`` ``(batch, heads, head_dim)`` over each sequence's filled slots,
        ``min(length, window)`` of them, in ring order (module docstring): ``(batch, heads, head_dim)``."""
        if bool((self.lengths == 0).any()):
            empty = torch.nonzero(self.lengths == 0).flatten().tolist()
            raise ValueError(f"sequences {empty} hold no token yet: append before attend")
        return attend_cached(q, self.k, self.v, self.lengths.clamp(max=self.window), scale=scale)
