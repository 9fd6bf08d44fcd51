"""The model runner: turn a scheduled batch into one forward pass over the paged cache, then sample.

Every sequence of the step contributes its new positions; they are *packed* into one row (no
padding), so a step that prefills a 300-token prompt and decodes 20 sequences is one forward pass
over 320 tokens. Next to the token ids the runner builds what attention needs to tell the
sequences apart::

    positions     (N,)    each token's position in its own sequence (RoPE)
    slots         (N,)    where its key and value go in the pool (block_table[p // bs] * bs + p % bs)
    cu_seqlens_q  (B+1,)  sequence i owns packed rows cu[i] .. cu[i+1]-1
    context_lens  (B,)    sequence i's length after this step
    block_tables  (B, M)  its blocks, padded with -1

and ``logits_at``: the last row of every sequence whose step reaches its last position — the
ones that sample a token (a prompt chunk that is not the last one samples nothing).
"""

from __future__ import annotations

import torch

from llmu.engine.scheduler import ScheduledBatch
from llmu.engine.sequence import Sequence
from llmu.models import decode_step
from llmu.models.sampling import next_token
from llmu.paged.cache import IMPLS, PagedKVCache

__all__ = ["ModelRunner", "PackedInputs"]


class PackedInputs:
    """The tensors of one step (see the module docstring), built on the CPU."""

    def __init__(self, batch: ScheduledBatch, tables: dict, block_size: int):
        ids, positions, slots, cu, lens, rows = [], [], [], [0], [], []
        self.sampling: list[Sequence] = []
        for seq, n in batch.entries:
            start, end = seq.num_computed, seq.num_computed + n
            table = tables[seq.seq_id]
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            cu.append(cu[-1] + n)
            lens.append(end)
            if end == seq.num_tokens:  # this step computes its last position: its logits pick a token
                rows.append(cu[-1] - 1)
                self.sampling.append(seq)
        width = max(len(tables[seq.seq_id]) for seq, _ in batch.entries)
        self.input_ids = torch.tensor(ids, dtype=torch.long)
        self.positions = torch.tensor(positions, dtype=torch.long)
        self.slots = torch.tensor(slots, dtype=torch.long)
        self.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32)
        self.context_lens = torch.tensor(lens, dtype=torch.int32)
        self.block_tables = torch.tensor([tables[s.seq_id] + [-1] * (width - len(tables[s.seq_id]))
                                          for s, _ in batch.entries], dtype=torch.int32)
        self.logits_at = torch.tensor(rows, dtype=torch.long)


class ModelRunner:
    """Runs ``model`` over a :class:`PagedKVCache`; ``impl`` picks the attention (see ``llmu.paged.cache``).

    The stock float32 model runs through ``llmu.models.decode_step.DecodeStep.packed``, the same
    arithmetic as its modules in fewer PyTorch operations (what ``generate`` uses too, so that one
    request through the engine costs what it costs through ``generate``); any other model runs
    through its modules. Which one is decided when the runner is built (``step_path``).
    """

    def __init__(self, model, pool: PagedKVCache, *, impl: str | None = None):
        if impl is not None and impl not in IMPLS:
            raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
        self.model, self.pool, self.impl = model, pool, impl
        self.step = None
        if decode_step.ENABLED and decode_step.unsupported(model) is None:
            self.step = decode_step.DecodeStep(model)
        self.step_path = "decode_step" if self.step is not None else "modules"

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, tables: dict) -> tuple[list[Sequence], torch.Tensor]:
        """Run the step; return the sequences that sample and their logits ``(K, vocab)``."""
        self.pool.copy_blocks(batch.copies)  # copy-on-write before anything writes
        packed = PackedInputs(batch, tables, self.pool.block_size)
        paged = self.pool.batch(packed.block_tables, packed.context_lens, packed.cu_seqlens_q, packed.slots,
                                impl=self.impl)
        if not packed.sampling:
            # nothing samples (every sequence is mid-prefill): still run the layers to fill the cache,
            # and project one row only
            at = packed.cu_seqlens_q[1:2] - 1
        else:
            at = packed.logits_at
        if self.step is not None:
            logits = self.step.packed(packed.input_ids, packed.positions, paged, at)
        else:
            logits = self.model(packed.input_ids[None], positions=packed.positions, cache=paged, logits_at=at).logits[0]
        return packed.sampling, (logits if packed.sampling else logits[:0])

    @staticmethod
    @torch.inference_mode()
    def sample(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """The next token of each sequence from its logits row (greedy ones in one batched argmax)."""
        tokens = [0] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy and s.params.repetition_penalty == 1]
        if greedy:
            picked = logits[greedy].argmax(dim=-1).tolist()
            for i, t in zip(greedy, picked):
                tokens[i] = t
        done = set(greedy)
        for i, seq in enumerate(seqs):
            if i in done:
                continue
            context = None
            if seq.params.repetition_penalty != 1:
                context = torch.tensor(seq.token_ids, device=logits.device)[None]
            tokens[i] = int(next_token(logits[i : i + 1], context, seq.params, seq.generator)[0])
        return tokens
