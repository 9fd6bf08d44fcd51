"""The scheduler: which sequences run in the next step, and how many of their tokens.

*Continuous* (iteration-level) batching decides again at every step, so a request joins the
running batch as soon as there is room and leaves it the moment it finishes. *Static* batching
(``policy="static"``) forms a batch (up to ``max_num_seqs`` requests, or as many as the memory
holds) and lets nobody join until every member has finished: the batch shrinks as short requests
end, and the slots they leave stay idle.

One step has a *token budget* (``max_num_batched_tokens``), the number of positions one forward
pass computes. The scheduler fills it in this order:

1. the running sequences, oldest first: one token each while decoding, or the next chunk of a
   prompt whose prefill is under way. Each needs room for its new positions; when the pool has
   no free block, the *youngest* running sequence is preempted — its blocks are freed and it goes
   back to the front of the queue, to be recomputed later (its prompt plus what it generated;
   with prefix caching most of it is usually still in the pool);
2. waiting sequences, first come first served, while the budget, ``max_num_seqs`` and the free
   blocks allow. A prompt longer than the remaining budget waits for the next step — or, with
   ``chunked_prefill``, starts with a chunk that fits.

``reserve`` says how much cache a sequence claims on admission: ``"blocks"`` (paging: only the
blocks of its prompt, more as it grows), ``"max_tokens"`` (prompt plus its whole output budget, as
a contiguous cache preallocated per request), or ``"context"`` (the model's whole context, as a
cache preallocated at the maximum length). The last two show what paging saves: fewer sequences
fit in the same memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmu.engine.sequence import Sequence, Status
from llmu.paged.block_manager import BlockManager

__all__ = ["SchedulerConfig", "ScheduledBatch", "Scheduler", "POLICIES", "RESERVES"]

POLICIES = ("continuous", "static")
RESERVES = ("blocks", "max_tokens", "context")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    chunked_prefill: bool = True
    policy: str = "continuous"
    reserve: str = "blocks"
    max_model_len: int = 2048

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.chunked_prefill, bool):
            raise TypeError(f"chunked_prefill must be a bool, got {self.chunked_prefill!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.reserve not in RESERVES:
            raise ValueError(f"reserve must be one of {RESERVES}, got {self.reserve!r}")


@dataclass
class ScheduledBatch:
    """What one step computes: ``(sequence, new positions)`` pairs, in the order they are packed."""

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write: (src block, dst block)
    preempted: list[Sequence] = field(default_factory=list)
    cached_tokens: int = 0  # prompt positions of newly admitted sequences found in the prefix cache

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


class Scheduler:
    """Queues of waiting and running sequences over one :class:`BlockManager`."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config, self.bm = config, block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._batch_open = True  # static batching: the batch is still being formed

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _extra_tokens(self, seq: Sequence) -> int:
        """Positions reserved on admission beyond the tokens the sequence has."""
        if self.config.reserve == "blocks":
            return 0
        if self.config.reserve == "max_tokens":
            return max(0, seq.num_prompt_tokens + seq.params.max_tokens - seq.num_tokens)
        return max(0, self.config.max_model_len - seq.num_tokens)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Free ``seq``'s blocks and queue it again at the front, to be recomputed (its prompt plus
        everything it generated so far)."""
        self.bm.free(seq.seq_id)
        self.running.remove(seq)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def schedule(self) -> ScheduledBatch:
        """Choose the next step's work (possibly nothing, when every queue is empty)."""
        cfg, bm = self.config, self.bm
        batch = ScheduledBatch()
        budget = cfg.max_num_batched_tokens
        # 1. the running sequences, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            start, end = seq.num_computed, seq.num_computed + n
            while not bm.can_write(seq.seq_id, start, end):
                victim = self.running[-1]  # the youngest gives way
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it preempted itself: every younger one is gone too
            batch.copies += bm.prepare_write(seq.seq_id, start, end)
            batch.entries.append((seq, n))
            budget -= n
            i += 1
        # 2. waiting sequences, first come first served. Static batching admits only while its
        #    batch is being formed: from the step the previous batch is gone until the batch is
        #    full (max_num_seqs, or the memory), over several steps if the prompts need them
        if cfg.policy == "static" and not self.running:
            self._batch_open = True
        if batch.preempted or (cfg.policy == "static" and not self._batch_open):
            return batch
        memory_full = False
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if not cfg.chunked_prefill and seq.num_tokens > budget:
                break  # the whole prompt must go in one step: wait for an emptier one
            extra = self._extra_tokens(seq)
            # one spare block: a prompt the prefix cache holds entirely still recomputes its last
            # position, and the block it falls in is shared, so it is copied first
            if bm.blocks_needed(seq.token_ids, extra) + 1 > bm.num_free_blocks:
                memory_full = True
                break
            cached = bm.allocate(seq.seq_id, seq.token_ids, extra)
            seq.num_computed = cached
            batch.cached_tokens += cached
            if seq.preemptions == 0:
                seq.cached_tokens = cached
            n = min(seq.num_tokens - cached, budget)
            batch.copies += bm.prepare_write(seq.seq_id, cached, cached + n)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.entries.append((seq, n))
            budget -= n
        if memory_full or len(self.running) >= cfg.max_num_seqs or not self.waiting:
            self._batch_open = False  # (static batching) the batch is formed: nobody joins it now
        return batch

    def computed(self, batch: ScheduledBatch) -> None:
        """Record that the step ran: advance ``num_computed`` and register the blocks now full."""
        for seq, n in batch.entries:
            seq.num_computed += n
            self.bm.commit(seq.seq_id, seq.token_ids, seq.num_computed)

    def finish(self, seq: Sequence, reason: str) -> None:
        """``seq`` is done: release its blocks."""
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
            self.bm.free(seq.seq_id)
