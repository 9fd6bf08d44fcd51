"""Module 09: PagedAttention — the KV cache in fixed-size blocks, shared, copied on write.

- ``llmu.paged.block_manager``: the bookkeeping (free list, block tables, reference counts,
  copy-on-write, prefix caching by block hash);
- ``llmu.paged.reference``: slots, writes, gathers and attention through block tables, in torch;
- ``llmu.paged.kernels``: the Triton kernels (paged decode, paged prefill);
- ``llmu.paged.cache``: the pool of blocks per layer and one step's packed batch, which the model
  takes as its ``cache``;
- ``llmu.paged.waste``: how much of a KV cache holds nothing, contiguous against paged;
- ``llmu.paged.bench``: benchmark entries.

The engine that schedules requests over this cache is ``llmu.engine`` (module 16). The notebook
is ``solutions/09_paged_attention/09_paged_attention.ipynb``.
"""

from __future__ import annotations

from llmu.paged import reference
from llmu.paged.block_manager import Block, BlockManager, NoFreeBlocks, block_hash
from llmu.paged.cache import PagedBatch, PagedKVCache, torch_paged_attention

__all__ = ["Block", "BlockManager", "NoFreeBlocks", "block_hash", "PagedBatch", "PagedKVCache",
           "torch_paged_attention", "reference"]
