"""Module 09's Triton kernels: paged decode and paged prefill == torch reference == contiguous SDPA.

Every case pages contiguous keys and values into a pool whose physical blocks are shuffled, with
spare blocks, and whose unused rows hold nan (``reference.to_paged``): a kernel that ignored the
block table, read past a sequence's length or dereferenced a -1 table entry would return nan or a
wrong answer. The same outputs are also compared with ``F.scaled_dot_product_attention`` on the
contiguous keys and values before paging.

Tolerances:

- float32: 2e-5 absolute on outputs of size O(1). The kernels use IEEE float32 products and the
  online softmax sums in another order than the references; the difference is rounding of sums of
  up to a thousand products (measured: below 1e-6).
- float16 / bfloat16: the kernels round p to the input dtype before ``p @ v`` (on a GPU) and the
  output to the input dtype; they are compared with a float32 reference computed from the same
  rounded inputs, so only that rounding counts: 3e-3 for fp16 (11-bit mantissa, outputs below 2),
  2e-2 for bf16 (8 bits; the interpreter's float32 -> bf16 cast may truncate rather than round,
  one ulp is 2**-7..2**-6 on outputs of size 1..4).
- the tiny model's logits (the model path): the same float32 rounding carried through two layers
  and a vocabulary projection with logits of size ~10: 1e-4 absolute and relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from llmu import runtime
from llmu.attention.reference import causal_mask
from llmu.models import LlamaModel, tiny_llama
from llmu.paged import PagedKVCache, kernels, reference

pytestmark = pytest.mark.kernels

DEV = runtime.kernel_device()
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make(lengths, h=9, hkv=3, d=64, block_size=16, *, dtype=torch.float32, seed=0, spare=3, poison=True):
    """Contiguous ``k``, ``v`` ``(B, Hkv, T, D)`` (CPU, float32) and the same positions paged on the
    kernel device in ``dtype``: ``(k, v, k_cache, v_cache, block_tables, context_lens, generator)``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, t = len(lengths), max(lengths)
    k = torch.randn(b, hkv, t, d, generator=g, device="cpu").to(dtype)
    v = torch.randn(b, hkv, t, d, generator=g, device="cpu").to(dtype)
    need = sum(-(-n // block_size) for n in lengths)
    kc, vc, tables, lens = reference.to_paged(k, v, lengths, block_size=block_size, num_blocks=need + spare,
                                              seed=seed)
    if not poison:
        kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    return k.float(), v.float(), kc.to(DEV), vc.to(DEV), tables.to(DEV), lens.to(DEV), g


def rand(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g, device="cpu").to(DEV, dtype)


def cu_of(q_lens):
    return torch.tensor([0] + torch.tensor(q_lens, device="cpu").cumsum(0).tolist(), dtype=torch.int32, device=DEV)


def sdpa_decode(q, k, v, lengths):
    """Contiguous attention (float32, CPU) of ``q`` ``(B, H, D)`` on each sequence's own positions."""
    q = q.float().cpu()
    return torch.stack([
        F.scaled_dot_product_attention(q[i][:, None], k[i, :, :n], v[i, :, :n], enable_gqa=True)[:, 0]
        for i, n in enumerate(lengths)])


def sdpa_prefill(q, k, v, cu, lengths):
    """Contiguous causal attention of each packed chunk: the last q_len of its ``lengths[i]`` positions."""
    q, cu = q.float().cpu(), cu.tolist()
    out = torch.empty_like(q)
    for i, n in enumerate(lengths):
        s, e = cu[i], cu[i + 1]
        mask = causal_mask(e - s, n, device="cpu")
        out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[i, :, :n], v[i, :, :n],
                                                  attn_mask=mask, enable_gqa=True).transpose(0, 1)
    return out


def close(out, want, dtype=torch.float32):
    torch.testing.assert_close(out.float().cpu(), want.float().cpu(), atol=TOL[dtype], rtol=0)


# -- decode --------------------------------------------------------------------------------------

# (lengths, H, Hkv, D, block_size): ragged with length 1 and one past a block boundary (17, 33, 65,
# 129), groups 3 (SmolLM2: 9/3, D 64), 1 (MHA), 4, 9 (MQA); batch 1; blocks of 16, 32 and 128 (a block
# longer than the kernel's 64-position tile); a long context
DECODE_CASES = [
    pytest.param([1, 17, 150], 9, 3, 64, 16, id="smollm2-ragged"),
    pytest.param([100], 4, 4, 32, 16, id="batch1-mha"),
    pytest.param([33, 65, 2], 16, 4, 128, 32, id="g4-bs32-d128"),
    pytest.param([64, 20], 9, 1, 64, 32, id="mqa"),
    pytest.param([129, 50], 4, 2, 32, 128, id="bs128"),
    pytest.param([1000], 6, 2, 32, 16, id="long"),
]


@pytest.mark.parametrize("lengths,h,hkv,d,bs", DECODE_CASES)
@pytest.mark.parametrize("splits", [1, 3, None], ids=["s1", "s3", "auto"])
def test_decode_matches_reference_and_sdpa(lengths, h, hkv, d, bs, splits):
    k, v, kc, vc, tables, lens, g = make(lengths, h, hkv, d, bs)
    q = rand(g, len(lengths), h, d)
    out = kernels.paged_decode_attention(q, kc, vc, tables, lens, num_splits=splits)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    close(out, reference.paged_decode_attention(q, kc, vc, tables, lens))
    close(out, sdpa_decode(q, k, v, lengths))


def test_decode_partials_merge_and_empty_splits():
    # 9 splits of lengths 1 and 70: most splits hold no position (lse -inf) and must weigh nothing
    k, v, kc, vc, tables, lens, g = make([1, 70], 6, 3, 32)
    q = rand(g, 2, 6, 32)
    pout, plse = kernels.paged_decode_partials(q, kc, vc, tables, lens, 9)
    assert pout.shape == (2, 6, 9, 32) and plse.shape == (2, 6, 9)
    assert torch.isinf(plse[0, :, 1:]).all() and torch.isinf(plse[1, :, 2:]).all()   # tiles of 64
    assert torch.isfinite(plse[1, :, :2]).all()
    from llmu.kvcache.kernels import combine_partials

    close(combine_partials(pout, plse), sdpa_decode(q, k, v, [1, 70]))


def test_decode_block_ids_int64_and_scale():
    k, v, kc, vc, tables, lens, g = make([40, 7], 4, 2, 32)
    q = rand(g, 2, 4, 32)
    out = kernels.paged_decode_attention(q, kc, vc, tables.long(), lens.long(), scale=0.3)
    close(out, reference.paged_decode_attention(q, kc, vc, tables, lens, scale=0.3))


# -- prefill -------------------------------------------------------------------------------------

# (lengths, q_lens, H, Hkv, D, block_size): chunks after a cached prefix (q_len < context), whole
# prompts (q_len == context), single tokens, chunks longer than one query tile, tiles that exit
# early (a short chunk next to a long one)
PREFILL_CASES = [
    pytest.param([1, 17, 40], [1, 17, 23], 9, 3, 64, 16, id="smollm2-mixed"),
    pytest.param([100], [100], 4, 4, 32, 32, id="batch1-whole-prompt"),
    pytest.param([65, 33, 80], [5, 33, 1], 8, 2, 64, 16, id="g4-after-prefix"),
    pytest.param([50, 70], [50, 10], 8, 1, 32, 32, id="mqa"),
    pytest.param([17, 140], [1, 130], 4, 2, 128, 128, id="bs128-early-exit"),
    pytest.param([1000], [120], 2, 1, 32, 16, id="long-prefix"),
]


@pytest.mark.parametrize("lengths,q_lens,h,hkv,d,bs", PREFILL_CASES)
def test_prefill_matches_reference_and_sdpa(lengths, q_lens, h, hkv, d, bs):
    k, v, kc, vc, tables, lens, g = make(lengths, h, hkv, d, bs)
    cu = cu_of(q_lens)
    q = rand(g, sum(q_lens), h, d)
    out = kernels.paged_prefill_attention(q, kc, vc, tables, cu, lens)
    assert out.shape == q.shape and out.dtype == q.dtype
    close(out, reference.paged_prefill_attention(q, kc, vc, tables, cu, lens))
    close(out, sdpa_prefill(q, k, v, cu, lengths))


def test_prefill_long_whole_prompt():
    # a 1000-token prompt in one chunk: 16 query tiles, each stopping at its own causal limit
    lengths = [1000]
    k, v, kc, vc, tables, lens, g = make(lengths, 2, 1, 16, 16)
    cu = cu_of(lengths)
    q = rand(g, 1000, 2, 16)
    close(kernels.paged_prefill_attention(q, kc, vc, tables, cu, lens, scale=0.2),
          reference.paged_prefill_attention(q, kc, vc, tables, cu, lens, scale=0.2))


def test_decode_equals_prefill_with_q_len_one():
    lengths = [1, 17, 150, 33]
    _, _, kc, vc, tables, lens, g = make(lengths)
    q = rand(g, 4, 9, 64)
    dec = kernels.paged_decode_attention(q, kc, vc, tables, lens, num_splits=2)
    pre = kernels.paged_prefill_attention(q, kc, vc, tables, cu_of([1, 1, 1, 1]), lens)
    close(dec, pre)


def test_empty_batch():
    _, _, kc, vc, _, _, _ = make([5], 4, 2, 32)
    tables = torch.zeros(0, 1, dtype=torch.int32, device=DEV)
    lens = torch.zeros(0, dtype=torch.int32, device=DEV)
    q = torch.zeros(0, 4, 32, device=DEV)
    assert kernels.paged_decode_attention(q, kc, vc, tables, lens).shape == (0, 4, 32)
    cu = torch.zeros(1, dtype=torch.int32, device=DEV)
    assert kernels.paged_prefill_attention(q, kc, vc, tables, cu, lens).shape == (0, 4, 32)


# -- other dtypes --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    # runs everywhere: float16 natively in the interpreter, bfloat16 through float32 dots there
    lengths, q_lens = [70, 20], [30, 1]
    k, v, kc, vc, tables, lens, g = make(lengths, 8, 2, 64, 16, dtype=dtype)
    q = rand(g, 2, 8, 64, dtype=dtype)
    out = kernels.paged_decode_attention(q, kc, vc, tables, lens, num_splits=2)
    assert out.dtype == dtype
    close(out, sdpa_decode(q, k, v, lengths), dtype)
    cu = cu_of(q_lens)
    qp = rand(g, sum(q_lens), 8, 64, dtype=dtype)
    outp = kernels.paged_prefill_attention(qp, kc, vc, tables, cu, lens)
    assert outp.dtype == dtype
    close(outp, sdpa_prefill(qp, k, v, cu, lengths), dtype)


@pytest.mark.skipif(runtime.interpreting(), reason="half precision over the whole grid is tested on a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths,h,hkv,d,bs", DECODE_CASES)
def test_half_precision_grid_on_gpu(dtype, lengths, h, hkv, d, bs):
    k, v, kc, vc, tables, lens, g = make(lengths, h, hkv, d, bs, dtype=dtype)
    q = rand(g, len(lengths), h, d, dtype=dtype)
    close(kernels.paged_decode_attention(q, kc, vc, tables, lens), sdpa_decode(q, k, v, lengths), dtype)
    q_lens = [max(1, n // 2) for n in lengths]
    cu = cu_of(q_lens)
    qp = rand(g, sum(q_lens), h, d, dtype=dtype)
    close(kernels.paged_prefill_attention(qp, kc, vc, tables, cu, lens), sdpa_prefill(qp, k, v, cu, lengths), dtype)


@pytest.mark.skipif(runtime.interpreting(), reason="long contexts are tested on a GPU")
def test_long_contexts_on_gpu():
    lengths = [16384, 9000, 1, 12345]
    k, v, kc, vc, tables, lens, g = make(lengths, 32, 8, 128, 16, dtype=torch.bfloat16, poison=False)
    q = rand(g, 4, 32, 128, dtype=torch.bfloat16)
    close(kernels.paged_decode_attention(q, kc, vc, tables, lens), sdpa_decode(q, k, v, lengths), torch.bfloat16)
    q_lens = [512, 300, 1, 700]
    cu = cu_of(q_lens)
    qp = rand(g, sum(q_lens), 32, 128, dtype=torch.bfloat16)
    close(kernels.paged_prefill_attention(qp, kc, vc, tables, cu, lens), sdpa_prefill(qp, k, v, cu, lengths),
          torch.bfloat16)


# -- random shapes -------------------------------------------------------------------------------


@settings(max_examples=5, deadline=None)
@given(b=st.integers(1, 3), hkv=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3, 5]),
       d=st.sampled_from([16, 32]), bs=st.sampled_from([16, 32]), t=st.integers(1, 120),
       splits=st.integers(1, 5), seed=st.integers(0, 999))
def test_random_shapes(b, hkv, group, d, bs, t, splits, seed):
    g0 = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g0, device="cpu").tolist()
    q_lens = [int(torch.randint(1, n + 1, (), generator=g0, device="cpu")) for n in lengths]
    h = hkv * group
    k, v, kc, vc, tables, lens, g = make(lengths, h, hkv, d, bs, seed=seed)
    q = rand(g, b, h, d)
    close(kernels.paged_decode_attention(q, kc, vc, tables, lens, num_splits=splits), sdpa_decode(q, k, v, lengths))
    cu = cu_of(q_lens)
    qp = rand(g, sum(q_lens), h, d)
    close(kernels.paged_prefill_attention(qp, kc, vc, tables, cu, lens), sdpa_prefill(qp, k, v, cu, lengths))


# -- the model path: PagedBatch(impl="triton") -----------------------------------------------------


def tiny_model(seed=0) -> LlamaModel:
    """A random 2-layer decoder with GQA (6 query heads, 2 KV heads) and head_dim 16 (the kernels' smallest)."""
    return tiny_llama(seed, hidden_size=64, intermediate_size=96, head_dim=16).to(DEV)


@torch.inference_mode()
def test_model_with_triton_paged_batch_matches_plain_forward():
    model = tiny_model()
    g = torch.Generator(device="cpu").manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=g, device="cpu") for n in (22, 9)]
    full = [model(s[None].to(DEV)).logits[0] for s in seqs]       # plain causal forward, no cache
    pool = PagedKVCache.for_model(model, num_blocks=6, block_size=16)
    tables = [[4, 1], [3]]
    # three engine steps: a chunked prefill next to a whole prompt, then the rest of the first
    # prompt next to a decode step (prefill kernel), then a decode step of both (decode kernel)
    steps = [((0, 12), (0, 7)), ((12, 20), (7, 8)), ((20, 21), (8, 9))]
    for step in steps:
        ids, positions, slots, q_lens = [], [], [], []
        for i, (s, e) in enumerate(step):
            ids.append(seqs[i][s:e])
            positions.append(torch.arange(s, e, device="cpu"))
            slots.append(reference.slot_mapping(tables[i], s, e, 16))
            q_lens.append(e - s)
        ctx = [e for _, e in step]
        cu = [0] + torch.tensor(q_lens, device="cpu").cumsum(0).tolist()
        padded = torch.tensor([tables[0], tables[1] + [-1]], device="cpu")     # unused entries -1: never read
        batch = pool.batch(padded, ctx, cu, torch.cat(slots), impl="triton")
        assert batch.decode_only == (sum(q_lens) == 2)
        logits = model(torch.cat(ids)[None].to(DEV), positions=torch.cat(positions).to(DEV), cache=batch).logits[0]
        want = torch.cat([full[i][s:e] for i, (s, e) in enumerate(step)])
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


# -- bad inputs ----------------------------------------------------------------------------------


def test_bad_inputs(off_device):
    _, _, kc, vc, tables, lens, g = make([40, 5], 4, 2, 32, poison=False)
    q = rand(g, 2, 4, 32)
    cu = cu_of([3, 5])
    qp = rand(g, 8, 4, 32)
    dec, pre = kernels.paged_decode_attention, kernels.paged_prefill_attention
    cases = [
        # dtypes
        (lambda: dec(q.half(), kc, vc, tables, lens), TypeError, "q has dtype torch.float16 but the cache holds"),
        (lambda: dec(q, kc, vc.half(), tables, lens), TypeError, "k_cache and v_cache must have one dtype"),
        (lambda: dec(q.long(), kc, vc, tables, lens), TypeError, "q must have dtype"),
        (lambda: dec(q, kc, vc, tables.float(), lens), TypeError, "block_tables must have dtype"),
        (lambda: dec(q, kc, vc, tables, lens.float()), TypeError, "context_lens must have dtype"),
        (lambda: pre(qp, kc, vc, tables, cu.float(), lens), TypeError, "cu_seqlens_q must have dtype"),
        # block size and head dim
        (lambda: dec(q, kc[:, :12].contiguous(), vc[:, :12].contiguous(), tables, lens), ValueError,
         "block_size .* must be a power of two >= 16"),
        (lambda: dec(q, kc[:, :8].contiguous(), vc[:, :8].contiguous(), tables, lens), ValueError,
         "block_size .* must be a power of two >= 16"),
        (lambda: dec(q[..., :24].contiguous(), kc[..., :24].contiguous(), vc[..., :24].contiguous(), tables, lens),
         ValueError, "head_dim must be one of"),
        (lambda: dec(q[..., :16].contiguous(), kc, vc, tables, lens), ValueError, "q has head_dim 16 but the cache"),
        (lambda: dec(q[:, :3].contiguous(), kc, vc, tables, lens), ValueError, "multiple of the cache's 2 KV heads"),
        (lambda: dec(q[0], kc, vc, tables, lens), ValueError, "q must have 3 dimensions"),
        # tables and lengths
        (lambda: dec(q, kc, vc, tables[:, :1], lens), ValueError, "block_tables has 1 columns but a context of 40"),
        (lambda: dec(q, kc, vc, tables, torch.zeros_like(lens)), ValueError, "context_lens must all be >= 1"),
        (lambda: dec(q, kc, vc, tables + kc.shape[0], lens), ValueError, "block_tables: the blocks the contexts use"),
        (lambda: dec(q, kc, vc, tables.clone().fill_(-1), lens), ValueError, "block_tables: the blocks"),
        (lambda: dec(q[:1], kc, vc, tables, lens), ValueError, "block_tables has 2 rows but the queries belong to 1"),
        # cu_seqlens
        (lambda: pre(qp, kc, vc, tables, cu_of([3, 5]).flip(0), lens), ValueError, "cu_seqlens_q must rise"),
        (lambda: pre(qp, kc, vc, tables, torch.tensor([0, 5, 5], device=DEV), lens), ValueError,
         "cu_seqlens_q must rise"),
        (lambda: pre(qp, kc, vc, tables, torch.tensor([0, 3, 7], device=DEV), lens), ValueError,
         r"from 0 to the number of query rows \(8\)"),
        (lambda: pre(qp, kc, vc, tables, torch.tensor([0, 8], device=DEV), lens), ValueError,
         "block_tables has 2 rows but the queries belong to 1"),
        (lambda: pre(qp, kc, vc, tables, cu_of([1, 7]), lens), ValueError, "more new tokens than positions"),
        (lambda: pre(qp, kc, vc, tables, cu[None], lens), ValueError, "cu_seqlens_q must have 1 dimensions"),
        # numbers
        (lambda: dec(q, kc, vc, tables, lens, num_splits=0), ValueError, "num_splits must be positive"),
        (lambda: dec(q, kc, vc, tables, lens, num_splits=1.5), TypeError, "num_splits must be a positive int"),
        (lambda: dec(q, kc, vc, tables, lens, scale=float("nan")), ValueError, "scale must be a finite number"),
        (lambda: pre(qp, kc, vc, tables, cu, lens, scale="x"), ValueError, "scale must be a finite number"),
        (lambda: dec(q, kc, vc, tables, lens, 0.1), TypeError, "positional"),
        # devices
        (lambda: dec(q.to(off_device), kc, vc, tables, lens), ValueError, f"q must be on {DEV.type}"),
        (lambda: dec(q, kc.to(off_device), vc.to(off_device), tables, lens), ValueError,
         f"k_cache must be on {DEV.type}"),
        (lambda: dec(q, kc, vc, tables.to(off_device), lens.to(off_device)), ValueError,
         f"block_tables must be on {DEV.type}"),
        (lambda: pre(qp, kc, vc, tables, cu.to(off_device), lens), ValueError, f"cu_seqlens_q must be on {DEV.type}"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()
