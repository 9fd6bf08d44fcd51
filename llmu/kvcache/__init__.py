"""Module 06: the KV cache.

- ``llmu.kvcache.reference``: PyTorch references: the cache's memory formula
  (``kv_cache_bytes``), writing new keys and values into a preallocated cache
  (``cache_update``), the cached attention step for one new token with ragged lengths
  (``attend_cached``), the flash-decoding split-and-merge in torch (``split_partials``,
  ``combine_partials_reference``), and greedy decoding with and without a cache
  (``decode_recompute``, ``decode_cached``);
- ``llmu.kvcache.kernels``: the Triton flash-decoding kernel (``decode_attention``, with the
  ``grouped`` switch module 07 benchmarks) and its merge step (``combine_partials``);
- ``llmu.kvcache.ring``: a sliding-window cache as a ring buffer (``RingKVCache``): the last
  ``window`` keys and values of each sequence, whatever the context's length;
- ``llmu.kvcache.bench``: benchmark entries (``kv_cache_decode``, ``decode_attention``).

The cache class itself is ``llmu.models.cache.KVCache`` (the one generation uses).
The notebook is ``solutions/06_kv_cache/06_kv_cache.ipynb``.
"""

from llmu.kvcache.kernels import combine_partials, decode_attention
from llmu.kvcache.reference import (
    attend_cached,
    cache_update,
    combine_partials_reference,
    decode_cached,
    decode_recompute,
    kv_cache_bytes,
    split_partials,
)

__all__ = [
    "attend_cached", "cache_update", "combine_partials", "combine_partials_reference", "decode_attention",
    "decode_cached", "decode_recompute", "kv_cache_bytes", "split_partials",
]
