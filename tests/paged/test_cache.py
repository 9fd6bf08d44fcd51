"""The CPU decode path of the paged cache (``llmu.paged.cache``): one index per step, and a lone
sequence whose blocks are consecutive read in place."""

from __future__ import annotations

import pytest
import torch

from llmu.paged import cache as cache_mod, reference
from llmu.paged.cache import DecodeIndex, PagedKVCache

ATOL = 2e-5


def _pool_with(tables_rows, lengths, *, layers=3, h=6, hkv=2, d=16, bs=4, num_blocks=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = PagedKVCache(layers, num_blocks, bs, hkv, d)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    width = max(len(r) for r in tables_rows)
    tables = torch.tensor([r + [-1] * (width - len(r)) for r in tables_rows], dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), h, d, generator=g)
    return pool, tables, lens, q


@pytest.mark.parametrize(("tables", "lengths", "view"), [
    ([[3, 4, 5]], [10], (12, 10)),            # one sequence, consecutive blocks: read in place
    ([[3, 7, 5]], [10], None),                # one sequence, scattered blocks: gathered
    ([[3, 4], [6, 7, 8]], [5, 11], None),     # two sequences: gathered, padded and masked
    ([[3, 4], [6, 7]], [7, 7], None),         # two of one length: gathered, no mask
])
def test_decode_index_reads_what_the_reference_reads(tables, lengths, view):
    pool, tables, lens, q = _pool_with(tables, lengths)
    index = DecodeIndex(tables, lens, pool.block_size)
    assert index.view == view
    if view is None:
        assert (index.mask is None) == (len(set(lengths)) == 1)
    for layer in range(pool.num_layers):
        kc, vc = pool.k[layer], pool.v[layer]
        torch.testing.assert_close(index.attend(q, kc, vc, scale=0.25),
                                   reference.paged_decode_attention(q, kc, vc, tables, lens, scale=0.25),
                                   atol=ATOL, rtol=0)


def test_a_lone_contiguous_sequence_is_read_in_place(monkeypatch):
    pool, tables, lens, q = _pool_with([[3, 4, 5]], [10])
    seen = []
    real = torch.bmm
    monkeypatch.setattr(cache_mod.torch, "bmm", lambda a, b: seen.append(b) or real(a, b))
    DecodeIndex(tables, lens, pool.block_size).attend(q, pool.k[0], pool.v[0], scale=0.25)
    keys_t, values = seen    # scores = q k^T, then weights @ v
    # the keys and values the two products read share the pool's memory: rows 12..21 of layer 0, no copy
    assert keys_t.untyped_storage().data_ptr() == pool.k[0].untyped_storage().data_ptr()
    assert values.untyped_storage().data_ptr() == pool.v[0].untyped_storage().data_ptr()
    assert keys_t.shape == (2, 16, 10) and values.shape == (2, 10, 16)


def test_a_step_builds_its_decode_index_once_for_every_layer(monkeypatch):
    pool, tables, lens, q = _pool_with([[3, 4], [6, 7, 8]], [5, 11])
    built = []
    real = cache_mod.DecodeIndex
    monkeypatch.setattr(cache_mod, "DecodeIndex", lambda *a: built.append(a) or real(*a))
    slots = torch.tensor([3 * 4 + 4, 8 * 4 + 2])   # each sequence's new (last) position
    batch = pool.batch(tables, lens, [0, 1, 2], slots, impl="torch")
    k_new = torch.randn(1, 2, 2, 16)
    for layer in range(pool.num_layers):
        out = batch.attend(layer, q.transpose(0, 1)[None], k_new, k_new, scale=0.25)
        want = reference.paged_decode_attention(q, pool.k[layer], pool.v[layer], tables, lens, scale=0.25)
        torch.testing.assert_close(out[0].transpose(0, 1), want, atol=ATOL, rtol=0)
    assert len(built) == 1
