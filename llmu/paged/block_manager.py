"""The block manager: which physical KV blocks each sequence owns, and which are free.

The paged cache is a pool of ``num_blocks`` blocks of ``block_size`` positions (16 by default).
The manager does the bookkeeping only; it never touches a tensor:

- a *free list* of the blocks nobody uses, least recently freed first;
- one *block table* per sequence: ``table[i]`` is the physical block holding its positions
  ``i * block_size .. (i + 1) * block_size - 1``;
- a *reference count* per block: how many tables list it. Two sequences may share a block when
  their positions there hold the same keys and values: the samples of one prompt (``fork``), or
  requests that start with the same system prompt (prefix caching, below);
- *copy-on-write*: a shared block is read-only. Before a sequence writes into it,
  :meth:`BlockManager.prepare_write` gives the sequence a private copy and returns the copy
  ``(src, dst)`` for the caller to perform on the pool;
- *prefix caching*: a full block whose keys and values have been computed is registered under the
  hash of its tokens *and of every token before it* (a chain: ``hash(parent_hash, tokens)``, since
  a key depends on the whole prefix). A new sequence whose first blocks hash the same reuses them
  instead of recomputing them. Freed blocks keep their contents and hash until the block is
  handed out again, so a prompt seen a moment ago is usually still cached;
- *truncation*: :meth:`BlockManager.truncate` keeps a sequence's first ``n`` positions and releases
  the blocks after them. Speculative decoding (module 11) rolls back rejected draft tokens with it.

When the pool runs dry an operation raises :class:`NoFreeBlocks` *before* changing anything, so
the scheduler can preempt a sequence and retry; ``can_*`` methods ask first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Block", "BlockManager", "NoFreeBlocks", "block_hash"]


class NoFreeBlocks(RuntimeError):
    """The pool has fewer free blocks than an operation needs (nothing was changed)."""


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The prefix-cache key of a full block: its tokens and (through ``parent``) all tokens before."""
    return hash((parent, tuple(tokens)))


@dataclass
class Block:
    """A physical block of the pool."""

    id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its keys/values are computed
    token_ids: tuple[int, ...] = ()  # the tokens behind ``hash`` (checked on a hit: hashes can collide)


class BlockManager:
    """Bookkeeping of a pool of ``num_blocks`` blocks of ``block_size`` positions.

    Sequences are named by any hashable ``seq_id``. Typical life of a sequence::

        cached = bm.allocate(seq, prompt)      # a table for the prompt; cached = positions reused
        copies = bm.prepare_write(seq, start, end)   # room (and private blocks) for positions start..end-1
        ... compute them; perform ``copies`` on the pool first ...
        bm.commit(seq, tokens, computed)       # register the blocks now full, for prefix caching
        bm.truncate(seq, n)                    # keep the first n positions only (rejected draft tokens)
        bm.free(seq)                           # when it finishes (or is preempted)
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, prefix_caching: bool = True):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching must be a bool, got {prefix_caching!r}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.tables: dict[Hashable, list[int]] = {}
        self._hashes: dict[Hashable, list[int]] = {}  # per sequence: hashes of its committed full blocks
        self.prefix_queries = 0  # full prompt blocks looked up in the prefix cache
        self.prefix_hits = 0  # ... and found there

    # -- counting -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` positions occupy: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: Hashable) -> list[int]:
        """The block table of ``seq_id`` (a copy)."""
        return list(self._table(seq_id))

    def _table(self, seq_id):
        try:
            return self.tables[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id!r} holds blocks") from None

    # -- taking and returning blocks ------------------------------------------------------------
    def _take(self) -> int:
        """A free block, the least recently freed one; it forgets what it held."""
        if not self._free:
            raise NoFreeBlocks("no free KV block left")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self._cached.get(block.hash) == block_id:
            del self._cached[block.hash]  # evicted from the prefix cache
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:
            raise RuntimeError(f"block {block_id} was released more often than it was taken")
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.hash is None:  # nothing worth keeping: hand this one out first
                self._free.move_to_end(block_id, last=False)

    def _lookup(self, h: int, tokens: tuple[int, ...]) -> int | None:
        block_id = self._cached.get(h)
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return block_id

    def _prefix_hits(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks of the prefix cache that hold the first full blocks of ``token_ids``, in order."""
        hits: list[int] = []
        if not self.prefix_caching:
            return hits
        parent, bs = None, self.block_size
        for i in range(len(token_ids) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = block_hash(parent, tokens)
            block_id = self._lookup(parent, tokens)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # -- a sequence's life ----------------------------------------------------------------------
    def blocks_needed(self, token_ids: Sequence[int], extra_tokens: int = 0) -> int:
        """Free blocks :meth:`allocate` would take for this prompt (plus ``extra_tokens`` reserved)."""
        hits = self._prefix_hits(token_ids)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # cached, but on the free list
        return self.blocks_for(len(token_ids) + extra_tokens) - len(hits) + revived

    def can_allocate(self, token_ids: Sequence[int], extra_tokens: int = 0) -> bool:
        return self.blocks_needed(token_ids, extra_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], extra_tokens: int = 0) -> int:
        """Give ``seq_id`` a block table for the positions of ``token_ids`` (plus ``extra_tokens``
        more, reserved now: a contiguous-cache policy reserves the whole output up front).

        Leading full blocks found in the prefix cache are shared, not recomputed. Returns how many
        leading positions already hold their keys and values — never all of them: the last prompt
        token is always computed, since its logits pick the first new token.
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if len(token_ids) == 0:
            raise ValueError("token_ids is empty: a sequence needs at least one token")
        if isinstance(extra_tokens, bool) or not isinstance(extra_tokens, int) or extra_tokens < 0:
            raise ValueError(f"extra_tokens must be an int >= 0, got {extra_tokens!r}")
        need = self.blocks_needed(token_ids, extra_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {need} free blocks, {self.num_free_blocks} are free")
        hits = self._prefix_hits(token_ids)
        self.prefix_queries += len(token_ids) // self.block_size
        self.prefix_hits += len(hits)
        table = []
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]  # back from the free list, contents intact
            block.ref_count += 1
            table.append(block_id)
        while len(table) < self.blocks_for(len(token_ids) + extra_tokens):
            table.append(self._take())
        self.tables[seq_id] = table
        self._hashes[seq_id] = [self.blocks[b].hash for b in hits]
        return min(len(hits) * self.block_size, len(token_ids) - 1)

    def write_needs(self, seq_id: Hashable, start: int, end: int) -> int:
        """Free blocks :meth:`prepare_write` would take for positions ``start .. end - 1``."""
        table = self._table(seq_id)
        grow = max(0, self.blocks_for(end) - len(table))
        first, last = start // self.block_size, min(self.blocks_for(end), len(table))
        shared = sum(1 for i in range(first, last) if self._read_only(table[i]))
        return grow + shared

    def can_write(self, seq_id: Hashable, start: int, end: int) -> bool:
        return self.write_needs(seq_id, start, end) <= self.num_free_blocks

    def _read_only(self, block_id: int) -> bool:
        """A block nobody may write into: shared by several tables, or registered in the prefix cache."""
        block = self.blocks[block_id]
        return block.ref_count > 1 or block.hash is not None

    def prepare_write(self, seq_id: Hashable, start: int, end: int) -> list[tuple[int, int]]:
        """Make positions ``start .. end - 1`` of ``seq_id`` writable: grow its table to cover them,
        and replace each read-only block they fall in by a private copy (copy-on-write).

        Returns the copies ``[(src, dst), ...]``: the caller copies block ``src`` of the pool to
        block ``dst`` (every layer, keys and values) before writing. Raises :class:`NoFreeBlocks`,
        changing nothing, when the pool cannot provide the blocks.
        """
        if not 0 <= start < end:
            raise ValueError(f"need 0 <= start < end, got start={start}, end={end}")
        need = self.write_needs(seq_id, start, end)
        if need > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {need} free blocks, {self.num_free_blocks} are free")
        table = self._table(seq_id)
        copies = []
        for i in range(start // self.block_size, min(self.blocks_for(end), len(table))):
            if self._read_only(table[i]):
                new = self._take()
                copies.append((table[i], new))
                self._release(table[i])
                table[i] = new
                del self._hashes[seq_id][i:]  # this block and the ones after are no longer registered
        while len(table) < self.blocks_for(end):
            table.append(self._take())
        return copies

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Record that the first ``num_computed`` positions of ``seq_id`` (tokens ``token_ids``) hold
        their keys and values: every block now full is registered in the prefix cache."""
        if not self.prefix_caching:
            return
        table, hashes = self._table(seq_id), self._hashes[seq_id]
        bs = self.block_size
        full = min(num_computed, len(token_ids)) // bs
        for i in range(len(hashes), min(full, len(table))):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(h)
            block = self.blocks[table[i]]
            if block.hash is None and h not in self._cached:
                block.hash, block.token_ids = h, tokens
                self._cached[h] = table[i]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Let ``child_id`` share every block of ``parent_id`` (parallel sampling of one prompt).

        Nothing is copied now; the first write of either into a shared block copies that block.
        """
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id!r} already holds blocks")
        table = self._table(parent_id)
        for block_id in table:
            self.blocks[block_id].ref_count += 1
        self.tables[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes[parent_id])

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` positions of ``seq_id`` (speculative decoding drops the
        rejected proposals so). The blocks after them are released, last block first, as :meth:`free`
        does; the hashes of the blocks no longer full are forgotten.

        The block the cut falls in stays in the table. If it is registered in the prefix cache it
        stays registered: its positions still hold the keys and values its hash names, and it stays
        read-only, so the next write into it goes through copy-on-write (:meth:`prepare_write`).
        """
        table = self._table(seq_id)
        covered = len(table) * self.block_size
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= covered:
            raise ValueError(f"num_tokens must be an int in 0..{covered} (the positions the table of {seq_id!r} "
                             f"covers), got {num_tokens!r}")
        keep = self.blocks_for(num_tokens)
        for block_id in reversed(table[keep:]):
            self._release(block_id)
        del table[keep:]
        del self._hashes[seq_id][num_tokens // self.block_size :]

    def free(self, seq_id: Hashable) -> None:
        """Return the blocks of ``seq_id``. Blocks still shared stay; the others go to the free list,
        last block first, so the prefix cache evicts a sequence's tail before its head."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            raise KeyError(f"no sequence {seq_id!r} holds blocks")
        self._hashes.pop(seq_id, None)
        for block_id in reversed(table):
            self._release(block_id)

    # -- a look inside --------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Plain data for pictures and tests: tables, reference counts, which blocks are cached/free."""
        return {
            "block_size": self.block_size,
            "tables": {k: list(v) for k, v in self.tables.items()},
            "ref_counts": [b.ref_count for b in self.blocks],
            "cached": sorted(self._cached.values()),
            "free": list(self._free),
        }

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (a test aid)."""
        counts = [0] * self.num_blocks
        for table in self.tables.values():
            for b in table:
                counts[b] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.id], f"block {block.id}: ref_count {block.ref_count} != {counts[block.id]} tables"
            assert (block.ref_count == 0) == (block.id in self._free), f"block {block.id}: free list disagrees with ref_count"
        for h, b in self._cached.items():
            assert self.blocks[b].hash == h, f"prefix cache entry of block {b} is stale"

    def __repr__(self) -> str:
        return (f"BlockManager(blocks={self.num_blocks}x{self.block_size}, free={self.num_free_blocks}, "
                f"sequences={len(self.tables)}, cached={len(self._cached)})")
