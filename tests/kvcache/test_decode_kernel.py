"""The flash-decoding kernel and its merge: Triton == torch reference == PyTorch's SDPA.

The kernel has two ways to cut the work (``grouped=True``: one program per KV head and its query
group; ``False``: one per query head, module 07's comparison); both are tested on every case.

Tolerances: float32 inputs agree to rounding (atol 2e-5: sums of a few thousand products in a
different order); bfloat16/float16 inputs (GPU only) are compared with a reference computed in
float32 from the same rounded inputs, so only the kernel's rounding of p to the input dtype
before p @ v and of the output counts: about 1e-2 for bf16 (8 bits of mantissa), 2e-3 for fp16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from llmu import runtime
from llmu.kvcache import kernels, reference

pytestmark = pytest.mark.kernels

DEV = runtime.kernel_device()
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def make(b, h, hkv, t, d, lengths, dtype=torch.float32, seed=0, poison=True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, h, d, generator=g, device="cpu")
    k = torch.randn(b, hkv, t, d, generator=g, device="cpu")
    v = torch.randn(b, hkv, t, d, generator=g, device="cpu")
    lengths = torch.tensor(lengths, dtype=torch.int64, device="cpu")
    if poison:  # padding past each length must never be read: fill it with nan
        for i, n in enumerate(lengths.tolist()):
            k[i, :, n:] = float("nan")
            v[i, :, n:] = float("nan")
    return tuple(x.to(DEV, dtype) for x in (q, k, v)) + (lengths.to(DEV),)


def sdpa(q, k, v, lengths):
    """PyTorch's attention, one sequence at a time (its own length, its own slice of the cache)."""
    outs = []
    for i, n in enumerate(lengths.tolist()):
        outs.append(F.scaled_dot_product_attention(q[i:i + 1, :, None].float(), k[i:i + 1, :, :n].float(),
                                                   v[i:i + 1, :, :n].float(), enable_gqa=True)[0, :, 0])
    return torch.stack(outs)


# (B, H, Hkv, max_len, D, lengths): ragged, batch 1, GQA groups 1 / 3 / 8 / all (MQA), long T.
CASES = [
    (3, 9, 3, 150, 64, [1, 77, 150]),        # SmolLM2's heads, ragged, one sequence of length 1
    (1, 4, 4, 100, 32, [100]),               # batch 1, group 1 (MHA)
    (2, 16, 2, 70, 128, [65, 3]),            # group 8, D=128, one length just past a block
    (2, 8, 1, 64, 64, [64, 20]),             # all query heads share one KV head (MQA)
    (1, 6, 2, 1500, 32, [1500]),             # a long row
]


@pytest.mark.parametrize("b,h,hkv,t,d,lengths", CASES)
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per_head"])
def test_kernel_matches_reference_and_sdpa(b, h, hkv, t, d, lengths, splits, grouped):
    q, k, v, n = make(b, h, hkv, t, d, lengths)
    out = kernels.decode_attention(q, k, v, n, num_splits=splits, grouped=grouped)
    ref = reference.attend_cached(q, k, v, n)
    assert out.shape == (b, h, d) and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=TOL[q.dtype], rtol=0)
    torch.testing.assert_close(out, sdpa(q, k, v, n), atol=TOL[q.dtype], rtol=0)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per_head"])
def test_more_splits_than_positions_and_empty_splits(grouped):
    # lengths 1 and 5 with 9 splits: most splits hold no position (lse -inf) and must weigh 0.
    q, k, v, n = make(2, 6, 3, 10, 32, [1, 5])
    pout, plse = kernels.decode_partials(q, k, v, n, 9, grouped=grouped)
    assert torch.isinf(plse[:, :, 1:]).all() and (plse[:, :, 1:] < 0).all()
    assert torch.isfinite(plse[:, :, 0]).all()
    torch.testing.assert_close(kernels.combine_partials(pout, plse), reference.attend_cached(q, k, v, n),
                               atol=2e-5, rtol=0)


def test_partials_match_the_torch_split():
    q, k, v, n = make(2, 6, 2, 300, 64, [300, 130])
    for s in (2, 5):
        pout, plse = kernels.decode_partials(q, k, v, n, s)
        rout, rlse = reference.split_partials(q, k, v, n, s, block=kernels.BLOCK_N)
        torch.testing.assert_close(plse, rlse, atol=2e-5, rtol=0)
        torch.testing.assert_close(pout, rout, atol=2e-5, rtol=0)


@pytest.mark.parametrize("h,hkv", [(4, 4), (9, 3), (16, 2), (8, 1)], ids=["MHA", "G3", "G8", "MQA"])
def test_grouped_and_per_head_give_the_same_partials(h, hkv):
    # Same splits, same arithmetic per query head: only which program does it differs. The tile
    # rows are computed independently, so the two agree to float32 rounding of the dot products.
    q, k, v, n = make(2, h, hkv, 140, 32, [140, 66])
    g_out, g_lse = kernels.decode_partials(q, k, v, n, 3, grouped=True)
    p_out, p_lse = kernels.decode_partials(q, k, v, n, 3, grouped=False)
    torch.testing.assert_close(p_lse, g_lse, atol=1e-6, rtol=0)
    torch.testing.assert_close(p_out, g_out, atol=1e-6, rtol=0)
    assert torch.isinf(g_lse[1, :, 2]).all()   # 66 positions, chunks of 64: the third split is empty


def test_scale_argument():
    q, k, v, n = make(1, 4, 2, 40, 32, [40])
    out = kernels.decode_attention(q, k, v, n, num_splits=2, scale=0.3)
    torch.testing.assert_close(out, reference.attend_cached(q, k, v, n, scale=0.3), atol=2e-5, rtol=0)


@pytest.mark.skipif(runtime.interpreting(), reason="half precision kernels are tested on a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,h,hkv,t,d,lengths", CASES)
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per_head"])
def test_half_precision_on_gpu(dtype, b, h, hkv, t, d, lengths, grouped):
    q, k, v, n = make(b, h, hkv, t, d, lengths, dtype=dtype)
    out = kernels.decode_attention(q, k, v, n, grouped=grouped)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference.attend_cached(q.float(), k.float(), v.float(), n),
                               atol=TOL[dtype], rtol=0)


@pytest.mark.skipif(runtime.interpreting(), reason="long contexts are tested on a GPU")
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per_head"])
def test_long_context_on_gpu(grouped):
    q, k, v, n = make(4, 32, 8, 16384, 128, [16384, 9000, 1, 12345], dtype=torch.bfloat16, poison=False)
    out = kernels.decode_attention(q, k, v, n, grouped=grouped)
    torch.testing.assert_close(out.float(), reference.attend_cached(q.float(), k.float(), v.float(), n),
                               atol=2e-2, rtol=0)


def test_half_precision_float16_in_the_interpreter():
    # float16 runs everywhere (the interpreter's numpy has float16); p is rounded to fp16 before
    # p @ v, about one fp16 ulp (~1e-3) on O(1) outputs, hence TOL[float16].
    q, k, v, n = make(2, 8, 2, 70, 64, [70, 33], dtype=torch.float16)
    for grouped in (True, False):
        out = kernels.decode_attention(q, k, v, n, grouped=grouped)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.float(), reference.attend_cached(q.float(), k.float(), v.float(), n),
                                   atol=TOL[torch.float16], rtol=0)


@settings(max_examples=6, deadline=None)
@given(b=st.integers(1, 3), hkv=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3, 8]),
       d=st.sampled_from([32, 64]), t=st.integers(1, 140), splits=st.integers(1, 6), seed=st.integers(0, 99),
       grouped=st.booleans())
def test_random_shapes(b, hkv, group, d, t, splits, seed, grouped):
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g, device="cpu").tolist()
    q, k, v, n = make(b, hkv * group, hkv, t, d, lengths, seed=seed)
    out = kernels.decode_attention(q, k, v, n, num_splits=splits, grouped=grouped)
    torch.testing.assert_close(out, reference.attend_cached(q, k, v, n), atol=2e-5, rtol=0)


# -- the merge on its own ------------------------------------------------------------------------


def test_combine_partials_matches_reference_and_logsumexp():
    g = torch.Generator(device="cpu").manual_seed(1)
    pout = torch.randn(2, 3, 5, 64, generator=g, device="cpu")
    plse = torch.randn(2, 3, 5, generator=g, device="cpu") * 4
    plse[0, 0, 2] = float("-inf")                       # one empty split
    pout[0, 0, 2] = float("nan")                        # whose output holds garbage
    plse[1, 2] = float("-inf")                          # a row with every split empty
    out, lse = kernels.combine_partials(pout.to(DEV), plse.to(DEV), return_lse=True)
    ref = reference.combine_partials_reference(pout, plse)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-6, rtol=0)
    assert torch.equal(out[1, 2].cpu(), torch.zeros(64, device="cpu"))
    want = torch.logsumexp(plse, dim=-1)
    torch.testing.assert_close(lse.cpu(), want, atol=1e-6, rtol=0)  # -inf where every split is empty


def test_combine_of_a_split_equals_one_pass():
    # Splitting then merging must give exactly the unsplit softmax: 1 split vs 4.
    q, k, v, n = make(1, 3, 3, 200, 32, [200], poison=False)
    one = kernels.combine_partials(*kernels.decode_partials(q, k, v, n, 1))
    four = kernels.combine_partials(*kernels.decode_partials(q, k, v, n, 4))
    torch.testing.assert_close(one, four, atol=2e-6, rtol=0)


def test_combine_out_dtype():
    g = torch.Generator(device="cpu").manual_seed(0)
    pout = torch.randn(1, 2, 3, 16, generator=g, device="cpu").to(DEV)
    plse = torch.zeros(1, 2, 3, device=DEV)
    out = kernels.combine_partials(pout, plse, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    # Equal weights: the mean of the splits, cast to bf16. The outputs are below 4 in size, where
    # one bf16 ulp is 2**-6 = 0.0156; the interpreter's cast may truncate instead of rounding, so
    # allow one ulp (a rounding cast stays within half of it).
    torch.testing.assert_close(out.float(), pout.mean(dim=2), atol=2 ** -6, rtol=0)


def test_combine_bad_inputs():
    pout = torch.zeros(1, 2, 3, 16, device=DEV)
    with pytest.raises(ValueError, match="partial_lse must have shape"):
        kernels.combine_partials(pout, torch.zeros(1, 2, 4, device=DEV))
    with pytest.raises(TypeError, match="partial_out must have dtype float32"):
        kernels.combine_partials(pout.half(), torch.zeros(1, 2, 3, device=DEV))
    with pytest.raises(ValueError, match="partial_out must have 4 dimensions"):
        kernels.combine_partials(pout[0], torch.zeros(1, 2, 3, device=DEV))


# -- bad inputs ----------------------------------------------------------------------------------


def test_bad_inputs():
    q, k, v, n = make(2, 6, 3, 16, 32, [16, 4], poison=False)
    with pytest.raises(ValueError, match="multiple of the KV-head count"):
        kernels.decode_attention(q[:, :5], k, v, n)
    with pytest.raises(TypeError, match="k_cache has dtype"):
        kernels.decode_attention(q, k.half(), v, n)
    with pytest.raises(ValueError, match="lengths must be <= the cache's max_len 16"):
        kernels.decode_attention(q, k, v, torch.tensor([17, 4], device=DEV))
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        kernels.decode_attention(q, k, v, torch.tensor([0, 4], device=DEV))
    with pytest.raises(ValueError, match="lengths must have shape"):
        kernels.decode_attention(q, k, v, torch.tensor([3], device=DEV))
    with pytest.raises(TypeError, match="lengths must have dtype"):
        kernels.decode_attention(q, k, v, n.float())
    with pytest.raises(ValueError, match="head_dim must be one of"):
        q2, k2, v2, n2 = make(1, 2, 2, 8, 48, [8], poison=False)
        kernels.decode_attention(q2, k2, v2, n2)
    with pytest.raises(ValueError, match="cache_v must have cache_k's shape"):
        kernels.decode_attention(q, k, v[:, :, :8], n)
    with pytest.raises(ValueError, match="q must be on|k_cache must be on|cache_k is on"):
        other = "cpu" if DEV.type == "cuda" else "meta"
        kernels.decode_attention(q, k.to(other), v, n)
    with pytest.raises(ValueError, match="num_splits must be positive"):
        kernels.decode_attention(q, k, v, n, num_splits=0)
    with pytest.raises(ValueError, match="num_splits must be positive"):
        kernels.decode_attention(q, k, v, n, num_splits=0, grouped=False)
    with pytest.raises(TypeError, match="grouped must be True or False"):
        kernels.decode_attention(q, k, v, n, grouped="yes")
    with pytest.raises(TypeError, match="keyword|positional"):
        kernels.decode_attention(q, k, v, n, 2)  # num_splits, scale and grouped are keyword-only
    if runtime.interpreting():
        with pytest.raises(TypeError, match="bfloat16 needs a GPU"):
            kernels.decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), n)


def test_choose_num_splits():
    assert kernels.choose_num_splits(1, 3, 10) == 1              # interpreter: one block, one split
    assert kernels.choose_num_splits(1, 3, 10_000) == 4
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        s = kernels.choose_num_splits(8, 8, 32768, "cuda")
        assert 8 * 8 * s >= 2 * sms and 32768 / s >= 256
        assert kernels.choose_num_splits(64, 8, 300, "cuda") <= 2  # no split shorter than 256 positions
