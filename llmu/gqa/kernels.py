"""Module 07's decode kernel: module 06's flash-decoding kernel, seen from grouped-query attention.

At decode time a sequence brings one new query per query head, and each of the ``H`` query heads
attends to the ``T`` cached keys and values of its KV head ``h // G`` (``G = H / Hkv`` query heads
per KV head). The arithmetic is tiny (two dot products of ``D`` numbers per cached position); the
cost is reading the cache. How many times the cache is read depends on how the work is cut:

- **grouped** (``grouped=True``, the default): one program per (sequence, *KV* head, split). The
  ``G`` queries of the group form a ``(G, D)`` tile and every block of keys and values is loaded
  once for all of them: one read of the cache, ``elem·2·B·Hkv·T·D`` bytes, whatever ``G``.
- **per head** (``grouped=False``): one program per (sequence, *query* head, split). The ``G``
  programs of a group each stream the same KV head: ``elem·2·B·H·T·D`` bytes, ``G`` times more,
  for the same answer.

There is one kernel for both: ``_decode_split_kernel`` in :mod:`llmu.kvcache.kernels` (module 06),
whose ``GROUPED`` switch picks the cut; :func:`llmu.kvcache.kernels.decode_attention` validates,
picks the split count and merges the splits with ``combine_partials``. The functions here only
give it module 07's names and let ``lengths`` default to full caches. ``llmu/gqa/bench.py`` runs it
both ways to measure what grouping saves.
"""

from __future__ import annotations

import torch

from llmu.kvcache.kernels import BLOCK_N, HEAD_DIMS, decode_attention, decode_partials

__all__ = ["gqa_decode", "gqa_decode_partials", "BLOCK_N", "HEAD_DIMS"]


def _full_lengths(q, k_cache, lengths):
    """``lengths`` if given; else every sequence uses its whole cache (``max_len`` positions)."""
    if lengths is None and isinstance(k_cache, torch.Tensor) and k_cache.ndim == 4:
        return torch.full((k_cache.shape[0],), k_cache.shape[2], dtype=torch.int32, device=k_cache.device)
    return lengths  # None with a bad k_cache: decode_attention's checks name the culprit


def gqa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor | None = None,
               *, num_splits: int | None = None, scale: float | None = None, grouped: bool = True) -> torch.Tensor:
    """One decode step of grouped-query attention against a padded KV cache.

    :func:`llmu.kvcache.kernels.decode_attention` with ``lengths`` optional (default: all
    ``max_len`` positions of every sequence). ``q (B, H, D)``; ``k_cache``, ``v_cache``
    ``(B, Hkv, max_len, D)`` with ``H`` a multiple of ``Hkv`` (``Hkv = H``: MHA; ``Hkv = 1``: MQA).
    ``grouped``: one program per KV head (each key read once) or per query head (each key read
    ``H/Hkv`` times); the result is the same. Returns ``(B, H, D)`` in q's dtype.
    """
    return decode_attention(q, k_cache, v_cache, _full_lengths(q, k_cache, lengths),
                            num_splits=num_splits, scale=scale, grouped=grouped)


def gqa_decode_partials(q, k_cache, v_cache, lengths=None, *, num_splits: int = 1, scale: float | None = None,
                        grouped: bool = True):
    """Phase 1 only (:func:`llmu.kvcache.kernels.decode_partials`): ``(partial_out (B, H, S, D),
    partial_lse (B, H, S))`` float32, the format ``combine_partials`` merges."""
    return decode_partials(q, k_cache, v_cache, _full_lengths(q, k_cache, lengths), num_splits, scale,
                           grouped=grouped)
