"""Decode's one-row products split over torch's threads (``llmu.models.llama._gemv_in_blocks``):
the same values as ``F.linear``, used only where it is meant to be, and the model's decode step
unchanged by it."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from llmu.bench.machine import Threads as threads  # torch's threads for a block, restored after
from llmu.models import llama
from llmu.models.llama import Linear, _gemv_blocks, tiny_llama


@contextlib.contextmanager
def split(on: bool):
    before = llama.SPLIT_GEMV
    llama.SPLIT_GEMV = on
    try:
        yield
    finally:
        llama.SPLIT_GEMV = before


# weird sizes too: 577 rows is prime (no split), 1155 = 3 * 5 * 7 * 11 (three blocks, not two)
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (576, 1536), (1155, 64), (577, 128), (49152, 8)])
@pytest.mark.parametrize("shape", [(1, -1), (-1,), (1, 1, -1), (3, -1), (2, 4, -1)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_split_product_of_a_few_rows_equals_f_linear(n, k, shape, bias):
    g = torch.Generator().manual_seed(n + k)
    lin = Linear(k, n, weight=torch.randn(n, k, generator=g), bias=bias)
    if bias:
        lin.bias.data = torch.randn(n, generator=g)
    rows = -torch.Size(shape).numel()       # the -1 stands for k
    x = torch.randn(rows * k, generator=g).reshape(shape)
    with threads(3), torch.no_grad():
        blocks = _gemv_blocks(x, lin.weight)
        got = lin(x)
    want = F.linear(x, lin.weight, lin.bias)
    assert blocks == (3 if n % 3 == 0 and n * k >= 1 << 16 else 1), blocks
    assert got.shape == want.shape
    # the same dot products over K, summed in an order the BLAS chooses (W on the left of a batched
    # GEMM, not F.linear's GEMV): float32 rounding apart. A sum of K products computed in any order
    # is within K * eps * sum_i |x_i w_i| of the exact value (eps = 2**-24, the unit roundoff, twice
    # for two computations); a wrong block or a lost row would be off by the size of the value itself.
    bound = 2 * k * 2.0**-24 * (x.abs().reshape(-1, k) @ lin.weight.abs().T).reshape(want.shape)
    bound = bound + 2.0**-23 * want.abs()                  # and the bias, added with one rounding each
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()


@pytest.mark.parametrize("rows", [2, 3, 8])
def test_a_few_rows_come_back_row_major(rows):
    """The next product reads this one's output: a column-major view there made MKL's product of
    the 1536-input down projection 5x slower for a verification pass of 2 rows."""
    w = torch.randn(1536, 576)
    with threads(2), torch.no_grad():
        blocks = _gemv_blocks(torch.randn(rows, 576), w)
        y = llama.blocked_product(w.view(blocks, -1, 576), torch.randn(rows, 576), None)
    assert blocks == 2 and y.shape == (rows, 1536) and y.is_contiguous()


def test_only_where_it_pays_and_nothing_can_go_wrong():
    w = torch.randn(1536, 576)
    row = torch.randn(1, 576)
    with threads(2):
        assert _gemv_blocks(row, w) == 2
        assert _gemv_blocks(torch.randn(4, 576), w) == 2            # a verification's few rows: split too
        assert _gemv_blocks(torch.randn(2, 4, 576), w) == 2          # 8 rows, the most that are split
        assert _gemv_blocks(torch.randn(9, 576), w) == 1             # prefill: a GEMM already uses the threads
        assert _gemv_blocks(row, w.t().contiguous().t()) == 1        # not contiguous: no free view in blocks
        assert _gemv_blocks(row, torch.randn(16, 576)) == 1          # too small to be worth a second thread
        assert _gemv_blocks(row.double(), w) == 1                    # mixed dtypes: F.linear raises its error
        wg = w.clone().requires_grad_()
        assert _gemv_blocks(row, wg) == 1                            # training: autograd keeps F.linear
        with torch.no_grad():
            assert _gemv_blocks(row, wg) == 2
        with split(False):
            assert _gemv_blocks(row, w) == 1
    with threads(1):
        assert _gemv_blocks(row, w) == 1


def test_a_decode_step_gives_the_same_logits_split_or_not(monkeypatch):
    model = tiny_llama(0, hidden_size=256, intermediate_size=512, vocab_size=1024)
    ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(0))
    calls = []
    real = llama._gemv_in_blocks
    monkeypatch.setattr(llama, "_gemv_in_blocks", lambda *a: calls.append(a[3]) or real(*a))
    steps = {}
    with threads(2), torch.no_grad():
        for on in (False, True):
            with split(on):
                cache = model.new_cache(max_len=16)
                model(ids[:, :-1], cache=cache)
                steps[on] = model(ids[:, -1:], cache=cache).logits
    # the split step went through every projection big enough (here gate, up and down of both
    # layers, and the head; q, k, v, o are under the size where a second thread pays)
    big = [m for m in model.modules() if isinstance(m, Linear) and m.weight.numel() >= llama._SPLIT_GEMV_MIN_WEIGHTS]
    assert len(big) == 7 and calls == [2] * len(big), calls
    torch.testing.assert_close(steps[True], steps[False], rtol=1e-6, atol=1e-5)
