"""Module 01: cosine similarity (reference and Triton kernel), top-k neighbours, PCA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401  (sets the Triton mode before triton is imported)
from llmu.embeddings import (
    cosine_similarity,
    cosine_similarity_matrix,
    pca,
    top_k_neighbours,
    top_k_neighbours_reference,
)
from llmu.runtime import kernel_device

pytestmark = pytest.mark.kernels

KDEV = kernel_device()  # where the kernels take their tensors: cpu (interpreter) or cuda (compiled)

# Tolerances. Cosines lie in [-1, 1]. In float32 the kernel sums D products in a different order
# than torch and divides by the norms after the dot product instead of before: a few float32
# ulps, 1e-6 absolute covers D up to a few thousand. 16-bit inputs are compared against the
# float32 result on the same (rounded) inputs: the output is rounded once to the 16-bit dtype
# (fp16 ulp near 1 is 2**-10; bf16 2**-7, doubled because the interpreter truncates; compiled on a
# GPU the casts round to nearest and fp16/bf16 tiles go through tensor cores with fp32 accumulation,
# which stays inside the same bounds).
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _randn(*shape, seed=0, dtype=torch.float32):
    # Seeded on the CPU (the same numbers on every machine), then moved to the kernel device.
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cpu").to(dtype).to(KDEV)


def _builtin(a, b):
    return F.cosine_similarity(a[:, None, :].float(), b[None, :, :].float(), dim=-1)


# ------------------------------------------------------------------------- reference and kernel


@pytest.mark.parametrize("q,v,d", [(1, 1, 1), (1, 7, 5), (5, 7, 9), (33, 100, 64), (17, 1000, 577), (64, 65, 576)])
def test_cosine_matches_reference_and_builtin(q, v, d):
    a, b = _randn(q, d, seed=1), _randn(v, d, seed=2)
    expected = _builtin(a, b)
    torch.testing.assert_close(cosine_similarity_matrix(a, b), expected, atol=TOL[torch.float32], rtol=0)
    torch.testing.assert_close(cosine_similarity(a, b), expected, atol=TOL[torch.float32], rtol=0)


@pytest.mark.parametrize("blocks", [(16, 16, 16), (16, 64, 32), (64, 16, 128)])
def test_cosine_block_sizes_do_not_change_the_result(blocks):
    a, b = _randn(40, 100, seed=3), _randn(70, 100, seed=4)
    bq, bv, bd = blocks
    out = cosine_similarity(a, b, block_q=bq, block_v=bv, block_d=bd)
    torch.testing.assert_close(out, _builtin(a, b), atol=TOL[torch.float32], rtol=0)


def test_zero_vectors_score_zero_like_torch():
    a, b = _randn(4, 32, seed=5), _randn(6, 32, seed=6)
    a[1] = 0.0
    b[2] = 0.0
    expected = _builtin(a, b)
    for fn in (cosine_similarity, cosine_similarity_matrix):
        out = fn(a, b)
        assert torch.isfinite(out).all()
        assert torch.all(out[1] == 0) and torch.all(out[:, 2] == 0)
        torch.testing.assert_close(out, expected, atol=TOL[torch.float32], rtol=0)


def test_tiny_vectors_follow_the_eps_clamp():
    # |a| = 1e-9 < eps = 1e-8: the norm is clamped to eps, so cos(a, b) = 1e-9 / 1e-8 = 0.1 for a
    # unit b along a, exactly as F.cosine_similarity computes it.
    a = torch.zeros(1, 16, device=KDEV)
    a[0, 0] = 1e-9
    b = torch.zeros(1, 16, device=KDEV)
    b[0, 0] = 1.0
    for fn in (cosine_similarity, cosine_similarity_matrix):
        torch.testing.assert_close(fn(a, b), _builtin(a, b), atol=1e-6, rtol=0)
        torch.testing.assert_close(fn(a, b), torch.tensor([[0.1]], device=KDEV), atol=1e-6, rtol=0)


def test_self_similarity_is_one_and_scale_does_not_matter():
    a = _randn(10, 48, seed=7)
    s = cosine_similarity(a, a * 1000.0)
    torch.testing.assert_close(s.diagonal(), torch.ones(10, device=KDEV), atol=1e-6, rtol=0)
    torch.testing.assert_close(s, s.T, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cosine_half_precision(dtype):
    a, b = _randn(9, 80, seed=8, dtype=dtype), _randn(30, 80, seed=9, dtype=dtype)
    out = cosine_similarity(a, b)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), _builtin(a, b), atol=TOL[dtype], rtol=0)


def test_strided_rows():
    big = _randn(12, 100, seed=10)
    a = big[::2, 10:74]  # rows 200 elements apart, contiguous along D
    b = big[1::3, 20:84]
    torch.testing.assert_close(cosine_similarity(a, b), _builtin(a, b), atol=TOL[torch.float32], rtol=0)


@settings(max_examples=10, deadline=None)
@given(q=st.integers(1, 40), v=st.integers(1, 200), d=st.integers(1, 130))
def test_cosine_random_shapes(q, v, d):
    a, b = _randn(q, d, seed=q * 1000 + v), _randn(v, d, seed=d)
    torch.testing.assert_close(cosine_similarity(a, b), _builtin(a, b), atol=TOL[torch.float32], rtol=0)


def test_cosine_bad_inputs(kdev, off_device):
    a = torch.randn(3, 8, device=kdev)
    with pytest.raises(ValueError, match="same row length"):
        cosine_similarity(a, torch.randn(4, 9, device=kdev))
    with pytest.raises(ValueError, match="a must have 2 dimensions"):
        cosine_similarity(torch.randn(8, device=kdev), a)
    with pytest.raises(TypeError, match="b has dtype"):
        cosine_similarity(a, torch.randn(4, 8, dtype=torch.float16, device=kdev))
    with pytest.raises(TypeError, match="a must have dtype"):
        cosine_similarity(a.double(), a.double())
    with pytest.raises(ValueError, match="b must be contiguous in its last dimension"):
        cosine_similarity(torch.randn(8, 8, device=kdev), torch.randn(8, 8, device=kdev).t())
    with pytest.raises(ValueError, match="block_v must be at least 16"):
        cosine_similarity(a, a, block_v=8)
    with pytest.raises(ValueError, match="block_q must be a power of two"):
        cosine_similarity(a, a, block_q=24)
    with pytest.raises(ValueError, match="eps must be positive"):
        cosine_similarity(a, a, eps=0.0)
    with pytest.raises(ValueError, match=f"b must be on {kdev.type}, got {off_device.type}"):
        cosine_similarity(a, torch.randn(4, 8, device=off_device))
    with pytest.raises(ValueError, match="same row length"):
        cosine_similarity_matrix(a, torch.randn(4, 9, device=kdev))


# ------------------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("fn", [top_k_neighbours, top_k_neighbours_reference])
def test_top_k_matches_a_full_sort(fn):
    table = _randn(300, 40, seed=11)
    queries = _randn(7, 40, seed=12)
    scores, idx = fn(queries, table, 5)
    full = _builtin(queries, table)
    order = full.argsort(dim=1, descending=True)[:, :5]
    assert scores.shape == idx.shape == (7, 5)
    assert torch.equal(idx, order)
    torch.testing.assert_close(scores, full.gather(1, order), atol=TOL[torch.float32], rtol=0)
    assert torch.all(scores[:, :-1] >= scores[:, 1:])  # sorted, most similar first


@pytest.mark.parametrize("fn", [top_k_neighbours, top_k_neighbours_reference])
def test_top_k_excludes_the_query_itself(fn):
    table = _randn(50, 16, seed=13)
    ids = torch.tensor([0, 17, 49], device=KDEV)
    _, with_self = fn(table[ids], table, 3)
    assert torch.equal(with_self[:, 0], ids)  # a row is its own nearest neighbour ...
    _, without = fn(table[ids], table, 3, exclude=ids)
    assert not (without == ids[:, None]).any()  # ... unless it is excluded
    assert torch.equal(without[:, :2], with_self[:, 1:])


@pytest.mark.parametrize("fn", [top_k_neighbours, top_k_neighbours_reference])
def test_top_k_bad_k(fn):
    table = _randn(10, 8, seed=14)
    q = table[:2]
    assert fn(q, table, 10)[1].shape == (2, 10)  # k == V is allowed
    with pytest.raises(ValueError, match="k=11 is larger than the 10 candidate rows"):
        fn(q, table, 11)
    with pytest.raises(ValueError, match="k=10 is larger than the 9 candidate rows after excluding"):
        fn(q, table, 10, exclude=torch.tensor([0, 1], device=KDEV))
    with pytest.raises(ValueError, match="k must be positive"):
        fn(q, table, 0)
    with pytest.raises(ValueError, match="exclude must have shape"):
        fn(q, table, 2, exclude=torch.tensor([0], device=KDEV))
    with pytest.raises(ValueError, match="exclude indices must lie in"):
        fn(q, table, 2, exclude=torch.tensor([0, 10], device=KDEV))


# --------------------------------------------------------------------------------------- PCA


def test_pca_finds_the_planted_directions():
    # PCA is plain torch (no kernel): it runs on the CPU on every machine, whatever the default device.
    with torch.device("cpu"):
        g = torch.Generator().manual_seed(15)
        basis = torch.linalg.qr(torch.randn(20, 2, generator=g))[0].T  # two orthonormal directions in R^20
        # Coordinates with zero mean and exactly uncorrelated columns (QR of centred noise), spread 100
        # along the first direction and 30 along the second: the principal axes are exactly `basis`.
        noise = torch.randn(200, 2, generator=g)
        coords = torch.linalg.qr(noise - noise.mean(0))[0] * torch.tensor([100.0, 30.0])
        x = coords @ basis + 5.0
        p = pca(x, 2)
        assert p.coords.shape == (200, 2) and p.components.shape == (2, 20)
        # Up to sign, the components are the planted directions, largest variance first.
        torch.testing.assert_close((p.components @ basis.T).abs(), torch.eye(2), atol=1e-4, rtol=0)
        torch.testing.assert_close(p.explained, torch.tensor([100.0**2, 30.0**2]) / (100.0**2 + 30.0**2), atol=1e-4, rtol=0)
        torch.testing.assert_close(p.coords.abs(), coords.abs(), atol=1e-3, rtol=0)
        torch.testing.assert_close(p.project(x), p.coords, atol=1e-3, rtol=0)
        # The sign convention: the largest-magnitude entry of each component is positive.
        assert torch.all(p.components.gather(1, p.components.abs().argmax(1, keepdim=True)) > 0)


def test_pca_bad_inputs():
    with pytest.raises(ValueError, match="k=3 components need"):
        pca(torch.randn(2, 10, device="cpu"), 3)
    with pytest.raises(ValueError, match="x must be a 2-D matrix"):
        pca(torch.randn(10, device="cpu"))
