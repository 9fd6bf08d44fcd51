"""Module 09's torch references: slots, writes, gathers, and attention through block tables.

The references are checked against plain contiguous attention (``F.scaled_dot_product_attention``
on each sequence's own keys and values, before they were paged), on ragged lengths whose blocks
were shuffled through the pool with spare blocks (``to_paged``); the pool's unused rows hold nan,
so a reference that read one would return nan.

Tolerances: float32 throughout; the reference and SDPA compute the same softmax in a different
order (the reference in float32 matmuls, SDPA in its own kernel), so they agree to rounding of
sums of a few hundred products: atol 2e-5 on outputs of size O(1). The gather/scatter round trips
move values without arithmetic and must be exact (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401
from llmu.attention.reference import causal_mask
from llmu.paged import reference
from llmu.paged.cache import torch_paged_attention

ATOL = 2e-5


def make(lengths, h=9, hkv=3, d=64, block_size=16, seed=0, spare=3):
    """Contiguous ``k``, ``v`` ``(B, Hkv, T, D)`` and the same positions paged into shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    k = torch.randn(b, hkv, t, d, generator=g)
    v = torch.randn(b, hkv, t, d, generator=g)
    need = sum(-(-n // block_size) for n in lengths)
    kc, vc, tables, lens = reference.to_paged(k, v, lengths, block_size=block_size, num_blocks=need + spare,
                                              seed=seed)
    return k, v, kc, vc, tables, lens, g


def sdpa_decode(q, k, v, lengths):
    """Contiguous attention of ``q`` ``(B, H, D)`` on each sequence's first ``lengths[b]`` positions."""
    return torch.stack([
        F.scaled_dot_product_attention(q[i][:, None], k[i, :, :n], v[i, :, :n], enable_gqa=True)[:, 0]
        for i, n in enumerate(lengths)])


def sdpa_prefill(q, k, v, cu, lengths):
    """Contiguous causal attention of each packed chunk (the last q_len of its ``lengths[i]`` positions)."""
    out = torch.empty_like(q)
    for i, n in enumerate(lengths):
        s, e = cu[i], cu[i + 1]
        mask = causal_mask(e - s, n)     # bottom-right: the chunk is the end of the sequence
        out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[i, :, :n], v[i, :, :n],
                                                  attn_mask=mask, enable_gqa=True).transpose(0, 1)
    return out


def cumulative(q_lens):
    return [0] + torch.tensor(q_lens).cumsum(0).tolist()


# -- to_paged, slots, writes and gathers ---------------------------------------------------------


def test_to_paged_layout_poisons_unused_rows():
    lengths = [1, 17, 40]
    k, v, kc, vc, tables, lens, _ = make(lengths, spare=4)
    assert kc.shape == (1 + 2 + 3 + 4, 16, 3, 64) and lens.tolist() == lengths
    assert tables.dtype == torch.int32 and tables.shape == (3, 3)
    assert tables[0, 1:].tolist() == [-1, -1] and tables[1, 2].item() == -1     # unused entries are -1
    used = tables[tables >= 0]
    assert used.unique().numel() == used.numel() == 6                             # no block used twice
    # every unused row (spare blocks, the tails of partly used blocks) is nan; the used ones are not
    rows_nan = torch.isnan(kc).all(-1).all(-1).sum().item()
    assert rows_nan == kc.shape[0] * 16 - sum(lengths)
    assert torch.isnan(vc).all(-1).all(-1).sum().item() == rows_nan
    assert tables[:, 0].tolist() != [0, 1, 3]                                     # shuffled (seed 0)


def test_slot_mapping_by_hand():
    table = torch.tensor([5, 2, 7])
    assert reference.slot_mapping(table, 0, 8, 4).tolist() == [20, 21, 22, 23, 8, 9, 10, 11]
    assert reference.slot_mapping(table, 3, 10, 4).tolist() == [23, 8, 9, 10, 11, 28, 29]
    assert reference.slot_mapping([1], 0, 0, 16).tolist() == []
    with pytest.raises(ValueError, match="do not fit a table of 3 blocks of 4"):
        reference.slot_mapping(table, 0, 13, 4)
    with pytest.raises(ValueError, match="do not fit"):
        reference.slot_mapping(table, 5, 4, 4)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_then_gather_round_trip(block_size):
    g = torch.Generator().manual_seed(3)
    nb, hkv, d, length = 9, 2, 8, 3 * block_size + 1
    kc = torch.zeros(nb, block_size, hkv, d)
    vc = torch.zeros_like(kc)
    table = torch.tensor([6, 0, 4, 2])
    k = torch.randn(length, hkv, d, generator=g)
    v = torch.randn(length, hkv, d, generator=g)
    # written in two pieces, as a prefill then a decode step would
    cut = length - 1
    reference.write_kv(kc, vc, k[:cut], v[:cut], reference.slot_mapping(table, 0, cut, block_size))
    reference.write_kv(kc, vc, k[cut:], v[cut:], reference.slot_mapping(table, cut, length, block_size))
    gk, gv = reference.gather_kv(kc, vc, table, length)
    assert gk.shape == (hkv, length, d)
    assert torch.equal(gk, k.transpose(0, 1)) and torch.equal(gv, v.transpose(0, 1))
    # nothing else of the pool was touched: exactly `length` rows are non-zero
    assert (kc.flatten(0, 1).abs().sum((-1, -2)) > 0).sum().item() == length


def test_gather_kv_reads_to_paged():
    lengths = [5, 33]
    k, v, kc, vc, tables, _, _ = make(lengths, block_size=16)
    for i, n in enumerate(lengths):
        gk, gv = reference.gather_kv(kc, vc, tables[i], n)
        assert torch.equal(gk, k[i, :, :n]) and torch.equal(gv, v[i, :, :n])


# -- attention through the tables == contiguous attention -----------------------------------------


# (lengths, H, Hkv, D, block_size): ragged incl. 1 and one past a block; groups 1, 3, 4, MQA; batch 1; long
CASES = [
    ([1, 17, 150], 9, 3, 64, 16),
    ([100], 4, 4, 32, 16),
    ([33, 65, 2], 16, 4, 128, 32),
    ([64, 20], 8, 1, 64, 32),
    ([1000], 6, 2, 32, 16),
]


@pytest.mark.parametrize("lengths,h,hkv,d,bs", CASES)
def test_decode_reference_matches_contiguous_sdpa(lengths, h, hkv, d, bs):
    k, v, kc, vc, tables, lens, g = make(lengths, h=h, hkv=hkv, d=d, block_size=bs)
    q = torch.randn(len(lengths), h, d, generator=g)
    out = reference.paged_decode_attention(q, kc, vc, tables, lens)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out, sdpa_decode(q, k, v, lengths), atol=ATOL, rtol=0)


@pytest.mark.parametrize("lengths,h,hkv,d,bs", CASES)
def test_prefill_reference_matches_contiguous_sdpa(lengths, h, hkv, d, bs):
    k, v, kc, vc, tables, lens, g = make(lengths, h=h, hkv=hkv, d=d, block_size=bs)
    # each chunk: the whole sequence, half of it after a cached prefix, or one token
    q_lens = [n if i % 3 == 0 else (max(1, n // 2) if i % 3 == 1 else 1) for i, n in enumerate(lengths)]
    cu = cumulative(q_lens)
    q = torch.randn(cu[-1], h, d, generator=g)
    out = reference.paged_prefill_attention(q, kc, vc, tables, torch.tensor(cu), lens)
    torch.testing.assert_close(out, sdpa_prefill(q, k, v, cu, lengths), atol=ATOL, rtol=0)


def test_prefill_with_q_len_one_is_decode():
    lengths = [3, 40, 17]
    _, _, kc, vc, tables, lens, g = make(lengths)
    q = torch.randn(3, 9, 64, generator=g)
    pre = reference.paged_prefill_attention(q, kc, vc, tables, torch.arange(4), lens)
    torch.testing.assert_close(pre, reference.paged_decode_attention(q, kc, vc, tables, lens), atol=1e-6, rtol=0)


def test_scale_argument():
    lengths = [20, 7]
    k, v, kc, vc, tables, lens, g = make(lengths, h=4, hkv=2, d=32)
    q = torch.randn(2, 4, 32, generator=g)
    want = torch.stack([F.scaled_dot_product_attention(q[i][:, None], k[i, :, :n], v[i, :, :n], scale=0.3,
                                                       enable_gqa=True)[:, 0] for i, n in enumerate(lengths)])
    torch.testing.assert_close(reference.paged_decode_attention(q, kc, vc, tables, lens, scale=0.3), want,
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "chunks"])
def test_torch_paged_attention_matches_reference(decode):
    # the model's CPU path (llmu.paged.cache) against the reference it is specified by
    lengths = [1, 17, 50]
    _, _, kc, vc, tables, lens, g = make(lengths)
    # The decode rows gather every table padded to the longest context; the padding repeats each
    # sequence's last real position, so the nan that to_paged leaves in unused rows is never read.
    q_lens = [1, 1, 1] if decode else [1, 17, 9]
    cu = torch.tensor(cumulative(q_lens), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 9, 64, generator=g)
    got = torch_paged_attention(q, kc, vc, tables, cu, lens, scale=0.125)
    torch.testing.assert_close(got, reference.paged_prefill_attention(q, kc, vc, tables, cu, lens), atol=ATOL,
                               rtol=0)


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 4), hkv=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3]),
       d=st.sampled_from([8, 16]), bs=st.sampled_from([1, 4, 16]), t=st.integers(1, 60),
       seed=st.integers(0, 999))
def test_random_shapes(b, hkv, group, d, bs, t, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g).tolist()
    q_lens = [int(torch.randint(1, n + 1, (), generator=g)) for n in lengths]
    k, v, kc, vc, tables, lens, g = make(lengths, h=hkv * group, hkv=hkv, d=d, block_size=bs, seed=seed)
    cu = cumulative(q_lens)
    q = torch.randn(cu[-1], hkv * group, d, generator=g)
    out = reference.paged_prefill_attention(q, kc, vc, tables, torch.tensor(cu), lens)
    torch.testing.assert_close(out, sdpa_prefill(q, k, v, cu, lengths), atol=ATOL, rtol=0)
    qd = q[torch.tensor(cu[1:]) - 1]          # each sequence's last query, as a decode step
    torch.testing.assert_close(reference.paged_decode_attention(qd, kc, vc, tables, lens),
                               sdpa_decode(qd, k, v, lengths), atol=ATOL, rtol=0)
    # the model's CPU path, on the same mixed batch (some chunks of one query, some longer)
    torch.testing.assert_close(torch_paged_attention(q, kc, vc, tables, torch.tensor(cu), lens, scale=d ** -0.5),
                               out, atol=ATOL, rtol=0)


# -- bad inputs: every check names its argument --------------------------------------------------


def test_check_paged_cache_bad_inputs():
    kc = torch.zeros(4, 16, 2, 8)
    assert reference.check_paged_cache(kc, kc.clone()) == (4, 16, 2, 8)
    cases = [
        ((kc[0], kc[0]), ValueError, "k_cache must have 4 dimensions"),
        ((kc, kc[0]), ValueError, "v_cache must have 4 dimensions"),
        ((kc.long(), kc), TypeError, "k_cache must have dtype"),
        ((kc, kc.long()), TypeError, "v_cache must have dtype"),
        ((kc, kc[:, :8]), ValueError, "k_cache and v_cache must have the same shape"),
        ((kc, kc.half()), TypeError, "k_cache and v_cache must have one dtype"),
        ((kc, kc.to("meta")), ValueError, "k_cache is on cpu but v_cache is on meta"),
        ((kc.transpose(1, 2).contiguous().transpose(1, 2), kc), ValueError, "must be contiguous"),
        ((kc.transpose(2, 3), kc.transpose(2, 3)), ValueError, "k_cache must be contiguous in its last dimension"),
        ((kc[:0], kc[:0]), ValueError, "k_cache must not be empty"),
        (("pool", kc), TypeError, "k_cache must be a torch.Tensor"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            reference.check_paged_cache(*args)


def test_check_block_tables_bad_inputs():
    tables = torch.tensor([[3, 1, -1], [0, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([20, 16])
    reference.check_block_tables(tables, lens, 16, 4, batch=2)            # fine: -1 entries are not reached
    cases = [
        ((tables[0], lens, 16, 4), ValueError, "block_tables must have 2 dimensions"),
        ((tables.float(), lens, 16, 4), TypeError, "block_tables must have dtype"),
        ((tables, lens.float(), 16, 4), TypeError, "context_lens must have dtype"),
        ((tables, lens[None], 16, 4), ValueError, "context_lens must have 1 dimensions"),
        ((tables, lens[:1], 16, 4), ValueError, "context_lens has 1 entries but block_tables has 2 rows"),
        ((tables, lens.to("meta"), 16, 4), ValueError, "block_tables is on cpu but context_lens is on meta"),
        ((tables, torch.tensor([20, 0]), 16, 4), ValueError, "context_lens must all be >= 1"),
        ((tables, torch.tensor([49, 1]), 16, 4), ValueError, "block_tables has 3 columns but a context of 49"),
        ((tables, torch.tensor([33, 1]), 16, 4), ValueError, r"must be in 0..3, got ids from -1"),   # -1 reached
        ((tables, lens, 16, 3), ValueError, r"must be in 0..2, got ids from 0 to 3"),               # id too big
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            reference.check_block_tables(*args)
    with pytest.raises(ValueError, match="block_tables has 2 rows but the queries belong to 3 sequences"):
        reference.check_block_tables(tables, lens, 16, 4, batch=3)


def test_attention_references_bad_inputs():
    _, _, kc, vc, tables, lens, g = make([20, 5], h=4, hkv=2, d=16)
    q = torch.randn(2, 4, 16, generator=g)
    decode = reference.paged_decode_attention
    with pytest.raises(ValueError, match="q has head_dim 8 but the cache has 16"):
        decode(q[..., :8], kc, vc, tables, lens)
    with pytest.raises(ValueError, match="q has 3 heads, which must be a positive multiple of the cache's 2 KV heads"):
        decode(q[:, :3], kc, vc, tables, lens)
    with pytest.raises(TypeError, match="q has dtype torch.float16 but the cache holds torch.float32"):
        decode(q.half(), kc, vc, tables, lens)
    with pytest.raises(ValueError, match="block_tables has 2 rows but the queries belong to 1"):
        decode(q[:1], kc, vc, tables, lens)
    prefill = reference.paged_prefill_attention
    cu = torch.tensor([0, 3, 5])
    qp = torch.randn(5, 4, 16, generator=g)
    prefill(qp, kc, vc, tables, cu, lens)
    for bad in ([0, 3, 3], [0, 5, 3], [1, 3, 5], [0, 3, 6]):
        with pytest.raises(ValueError, match="cu_seqlens_q must rise strictly from 0 to the number of query rows"):
            prefill(qp, kc, vc, tables, torch.tensor(bad), lens)
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype"):
        prefill(qp, kc, vc, tables, cu.float(), lens)
    with pytest.raises(ValueError, match="cannot have more new tokens than positions"):
        prefill(torch.randn(10, 4, 16), kc, vc, tables, torch.tensor([0, 4, 10]), lens)


def test_write_kv_and_to_paged_bad_inputs():
    kc = torch.zeros(4, 16, 2, 8)
    vc = torch.zeros_like(kc)
    k = torch.zeros(3, 2, 8)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"k must be \(tokens, kv_heads=2, head_dim=8\)"):
        reference.write_kv(kc, vc, k[:, :1], k, slots)
    with pytest.raises(TypeError, match="v has dtype torch.float16 but the cache holds torch.float32"):
        reference.write_kv(kc, vc, k, k.half(), slots)
    with pytest.raises(ValueError, match=r"slots \(2\), k \(3\) and v \(3\) must count the same tokens"):
        reference.write_kv(kc, vc, k, k, slots[:2])
    with pytest.raises(TypeError, match="slots must have dtype"):
        reference.write_kv(kc, vc, k, k, slots.float())
    kk = torch.zeros(2, 2, 10, 8)
    with pytest.raises(ValueError, match="lengths must give 1..10 positions for each of the 2 sequences"):
        reference.to_paged(kk, kk, [0, 3])
    with pytest.raises(ValueError, match=r"num_blocks \(1\) is fewer than the 2 blocks"):
        reference.to_paged(kk, kk, [3, 3], block_size=4, num_blocks=1)
