"""Module 07: GQA, MQA and MLA — fewer (or smaller) keys and values per token.

- ``reference``: KV-head pooling (MHA -> GQA -> MQA) for weights and whole models, MLA with its
  absorbed-weight decode, KV bytes per token of each scheme;
- ``kernels``: ``gqa_decode``, module 06's decode kernel (``llmu.kvcache.kernels``) under module 07's
  name: grouped (each KV head read once for its whole query group) or per query head;
- ``bench``: its benchmark entry (grouped vs per-head programs);
- ``precompute``: the script behind ``llmu/data/gqa_perplexity.json``.
"""

from llmu.gqa.reference import (
    DEEPSEEK_V2_LIKE,
    MLAWeights,
    convert_kv_heads,
    kv_bytes_per_token,
    kv_cache_table,
    mla_absorbed,
    mla_decode,
    mla_unabsorbed,
    pool_kv_heads,
)

__all__ = [
    "DEEPSEEK_V2_LIKE",
    "MLAWeights",
    "convert_kv_heads",
    "kv_bytes_per_token",
    "kv_cache_table",
    "mla_absorbed",
    "mla_decode",
    "mla_unabsorbed",
    "pool_kv_heads",
]
