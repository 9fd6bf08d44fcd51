"""GPTQ (``llmu.quant.gptq``) and the calibration helpers it runs on (``llmu.quant.calibration``).

What is checked:

- against a textbook re-implementation (no Cholesky trick, no lazy batches: the inverse Hessian
  of the remaining columns is recomputed at every step), for ragged shapes and groups that
  straddle the lazy blocks: the same codes;
- lazy batching changes nothing (block sizes 1, 5, 128 give the same codes);
- exact properties: a *diagonal* Hessian (``H = I`` included, damped or not) leaves nothing to
  feed back, so GPTQ returns RTN's codes and scales; the first column is always RTN's;
- on correlated synthetic inputs the layer's output error ``||(W - Q) X||`` is below RTN's, for
  every bit width, group size, act_order and symmetric/asymmetric;
- dead inputs, no mutation of ``w`` or ``H``, dtypes, the Hessian accumulation, bad inputs;
- the whole-model driver on the tiny random decoder, and once on SmolLM2's first block.

Tolerances: codes are compared exactly. The textbook comparison and the block-size comparison
compute the same numbers in a different order (float32), which could move a weight that sits
within a few ulps of a rounding boundary to the other code; we allow a mismatch in at most 0.5%
of the codes (none occurred when these tests were written). The Hessian accumulation agrees to
float32 rounding of sums over a few hundred products (rtol 1e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401
from llmu.models import tiny_llama
from llmu.quant.calibration import SEQUENTIAL_GROUPS, BlockRunner, calibration_ids, split_ids
from llmu.quant.formats import dequantize, quant_params, quantize
from llmu.quant.gptq import gptq_quantize, hessian, output_error, quantize_model_gptq

MISMATCH = 0.005  # fraction of codes allowed to differ when the same math runs in another order


def _correlated(n_tokens, k, seed=0, dead=()):
    """Inputs whose features are mixed by a random matrix (correlated), a few with large scale."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + 0.5 * torch.eye(k)
    x = torch.randn(n_tokens, k, generator=g) @ mix
    x[:, : max(1, k // 16)] *= 5  # a few loud channels
    for j in dead:
        x[:, j] = 0
    return x


def _weight(n, k, seed=1, dtype=torch.float32):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _textbook_gptq(w, H, bits, group_size, symmetric=False, percdamp=0.01):
    """Column by column with the explicit inverse of the remaining Hessian (Optimal Brain Surgeon)."""
    W = w.double().clone()
    H = H.double().clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += percdamp * torch.diagonal(H).mean() * torch.eye(len(H), dtype=H.dtype)
    n, k = W.shape
    maxq = 2**bits - 1
    codes = torch.zeros(n, k)
    for j in range(k):
        if j % group_size == 0:
            s, z = quant_params(W[:, j:j + group_size].float(), bits, symmetric=symmetric)
            s, z = s[:, 0].double(), z[:, 0].double()
        q = torch.clamp(torch.round(W[:, j] / s) + z, 0, maxq)
        codes[:, j] = q
        hinv = torch.linalg.inv(H[j:, j:])
        err = (W[:, j] - (q - z) * s) / hinv[0, 0]
        W[:, j:] -= err[:, None] * hinv[0][None, :]
    return codes


def _mismatch(a, b):
    return (a.to(torch.int16) != b.to(torch.int16)).float().mean().item()


# -- the algorithm --------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,group,blocksize", [(8, 24, 8, 16), (5, 40, 8, 12), (1, 30, 10, 7), (16, 64, 64, 128)])
@pytest.mark.parametrize("bits", [3, 4])
def test_matches_textbook_obs(n, k, group, blocksize, bits):
    x = _correlated(256, k)
    w = _weight(n, k)
    H, _ = hessian(x)
    got = gptq_quantize(w, H, bits, group_size=group, blocksize=blocksize)
    want = _textbook_gptq(w, H, bits, group)
    assert _mismatch(got.codes, want) <= MISMATCH


@pytest.mark.parametrize("group", [4, 12, 48])
def test_lazy_blocks_change_nothing(group):
    x, w = _correlated(200, 48, seed=3), _weight(10, 48, seed=4)
    H, _ = hessian(x)
    codes = [gptq_quantize(w, H, 3, group_size=group, blocksize=b).codes for b in (1, 5, 128)]
    assert _mismatch(codes[0], codes[1]) <= MISMATCH and _mismatch(codes[0], codes[2]) <= MISMATCH


@pytest.mark.parametrize("granularity,group", [("group", 16), ("group", 8), ("channel", 0), ("tensor", 0)])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("percdamp", [0.0, 0.01, 10.0])
def test_diagonal_hessian_is_rtn(granularity, group, act_order, symmetric, percdamp):
    # diagonal H -> diagonal Cholesky factor of H^-1 -> no error feedback: RTN exactly
    w = _weight(12, 32)
    fmt = dict(group_size=group or 32, granularity=granularity, symmetric=symmetric)
    for H in (torch.eye(32), torch.diag(torch.rand(32, generator=torch.Generator().manual_seed(5)) + 0.1)):
        got = gptq_quantize(w, H, 4, percdamp=percdamp, act_order=act_order, **fmt)
        want = quantize(w, 4, **fmt)
        assert torch.equal(got.codes, want.codes)
        assert torch.equal(got.scale, want.scale) and torch.equal(got.zero, want.zero)


def test_first_column_is_rtn():
    x, w = _correlated(300, 32), _weight(20, 32)
    H, _ = hessian(x)
    got = gptq_quantize(w, H, 3, group_size=8)
    want = quantize(w, 3, group_size=8)
    assert torch.equal(got.codes[:, 0], want.codes[:, 0])
    assert torch.equal(got.scale[:, 0], want.scale[:, 0])
    assert not torch.equal(got.codes, want.codes)  # ... and the feedback changes the rest


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [8, 32, 64])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
def test_output_error_below_rtn(bits, group, act_order, symmetric):
    x, w = _correlated(512, 64, seed=bits), _weight(24, 64, seed=group)
    H, _ = hessian(x)
    fmt = dict(group_size=group, symmetric=symmetric)
    gptq = output_error(w, dequantize(gptq_quantize(w, H, bits, act_order=act_order, **fmt)), x)
    rtn = output_error(w, dequantize(quantize(w, bits, **fmt)), x)
    assert gptq < rtn


def test_act_order_keeps_static_groups():
    # with act_order the groups' parameters come from the original weights: RTN's scales and zeros
    x, w = _correlated(300, 32, seed=7), _weight(6, 32, seed=8)
    H, _ = hessian(x)
    got = gptq_quantize(w, H, 4, group_size=8, act_order=True)
    want = quantize(w, 4, group_size=8)
    assert torch.equal(got.scale, want.scale) and torch.equal(got.zero, want.zero)
    static = gptq_quantize(w, H, 4, group_size=8, static_groups=True)
    assert torch.equal(static.scale, want.scale)


def test_dead_inputs():
    dead = (0, 5, 31)
    x, w = _correlated(256, 32, dead=dead), _weight(8, 32)
    H, _ = hessian(x)
    assert all(H[j, j] == 0 for j in dead)
    qt = gptq_quantize(w, H, 4, group_size=8)
    wq = dequantize(qt)
    assert torch.isfinite(wq).all()
    assert (wq[:, list(dead)] == 0).all()  # a dead column is zeroed (0 is exact in the format)
    assert output_error(w, wq, x) < output_error(w, dequantize(quantize(w, 4, group_size=8)), x)
    # an all-dead layer (H = 0) is quantized as zeros, without failing
    assert (dequantize(gptq_quantize(w, torch.zeros(32, 32), 4, group_size=8)) == 0).all()


def test_inputs_not_mutated_and_dtypes():
    x = _correlated(128, 16, dead=(3,))
    H, _ = hessian(x)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        w = _weight(4, 16, dtype=dtype)
        w0, H0 = w.clone(), H.clone()
        qt = gptq_quantize(w, H, 4, group_size=8, act_order=True)
        assert torch.equal(w, w0) and torch.equal(H, H0)
        assert qt.dtype == dtype and dequantize(qt).dtype == dtype
        assert qt.codes.dtype == torch.uint8 and qt.scale.shape == (4, 2)


def test_hessian_accumulates():
    x = _correlated(300, 12)
    whole, n = hessian(x)
    assert n == 300
    torch.testing.assert_close(whole, 2 * x.T @ x / 300, rtol=1e-5, atol=1e-5)
    h, n = None, 0
    for part in (x[:7], x[7:150], x[150:]):
        h, n = hessian(part, h, n)
    torch.testing.assert_close(h, whole, rtol=1e-5, atol=1e-5)
    h3, _ = hessian(x.reshape(3, 100, 12))  # leading dims are tokens too
    torch.testing.assert_close(h3, whole, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), groups=st.integers(1, 4), group=st.sampled_from([1, 2, 3, 8]),
       bits=st.sampled_from([2, 3, 4, 8]), symmetric=st.booleans(), act_order=st.booleans(), seed=st.integers(0, 99))
def test_random_shapes(n, groups, group, bits, symmetric, act_order, seed):
    k = groups * group
    x, w = _correlated(64, k, seed=seed), _weight(n, k, seed=seed)
    H, _ = hessian(x)
    qt = gptq_quantize(w, H, bits, group_size=group, symmetric=symmetric, act_order=act_order, blocksize=5)
    assert qt.codes.shape == (n, k) and int(qt.codes.max()) <= 2**bits - 1
    assert qt.scale.shape == (n, groups) and (qt.scale > 0).all()
    assert torch.isfinite(dequantize(qt)).all()
    diag = gptq_quantize(w, torch.diag(torch.diagonal(H)), bits, group_size=group, symmetric=symmetric)
    assert torch.equal(diag.codes, quantize(w, bits, group_size=group, symmetric=symmetric).codes)


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(H=torch.eye(3)), ValueError, "H must be"),
    (dict(H=torch.eye(8)[:, :4]), ValueError, "H must be"),
    (dict(H=torch.eye(8, dtype=torch.int64)), TypeError, "H must be floating"),
    (dict(H=torch.full((8, 8), float("nan"))), ValueError, "inf or nan"),
    (dict(H=-torch.eye(8)), ValueError, "negative diagonal"),
    (dict(H=torch.tensor([[1.0, 2.0], [2.0, 1.0]]).repeat(4, 4), percdamp=0.0), ValueError, "raise percdamp"),
    (dict(H="eye"), TypeError, "H must be a torch.Tensor"),
    (dict(bits=5), ValueError, "bits"),
    (dict(group_size=3), ValueError, "does not divide"),
    (dict(granularity="row"), ValueError, "granularity"),
    (dict(percdamp=-0.1), ValueError, "percdamp"),
    (dict(percdamp=float("nan")), ValueError, "percdamp"),
    (dict(blocksize=0), ValueError, "blocksize"),
    (dict(w=torch.ones(8)), ValueError, "2-D"),
    (dict(w=torch.ones(2, 8, dtype=torch.int32)), TypeError, "float32"),
])
def test_bad_inputs(kwargs, err, match):
    args = dict(w=_weight(2, 8), H=torch.eye(8), bits=4, group_size=4)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        gptq_quantize(args.pop("w"), args.pop("H"), args.pop("bits"), **args)


# -- calibration ----------------------------------------------------------------------------------

def test_calibration_ids_seeded():
    ids = torch.arange(1000)
    a = calibration_ids(ids, n_samples=5, seq_len=40, seed=3)
    assert a.shape == (5, 40) and a.dtype == torch.long
    assert torch.equal(a, calibration_ids(ids, n_samples=5, seq_len=40, seed=3))
    assert not torch.equal(a, calibration_ids(ids, n_samples=5, seq_len=40, seed=4))
    assert (a[:, 1:] - a[:, :-1] == 1).all()  # contiguous windows of the text
    assert calibration_ids(list(range(40)), n_samples=2, seq_len=40).shape == (2, 40)  # the whole text
    first, second = split_ids(ids)
    assert torch.equal(torch.cat([first, second]), ids) and len(first) == 500


@pytest.mark.parametrize("call,match", [
    (lambda: calibration_ids(torch.arange(10), seq_len=11), "longer than the text"),
    (lambda: calibration_ids(torch.arange(10), n_samples=0, seq_len=4), "n_samples"),
    (lambda: calibration_ids(torch.zeros(2, 5, dtype=torch.long), seq_len=4), "1-D"),
    (lambda: calibration_ids(torch.rand(10), seq_len=4), "integer"),
    (lambda: split_ids(torch.arange(10), 1.5), "fraction"),
    (lambda: split_ids(torch.arange(3), 0.5), "at least 2"),
])
def test_calibration_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_block_runner_follows_the_model():
    model = tiny_llama(0)
    ids = torch.randint(0, 97, (5, 12), generator=torch.Generator().manual_seed(0))
    hidden = model(ids, output_hidden_states=True).hidden_states
    runner = BlockRunner(model, ids, batch_size=2)
    assert runner.tokens == 60
    layer = model.layers[0]
    names = [n for group in SEQUENTIAL_GROUPS for n in group]
    inputs = runner.capture(layer, names)
    normed = layer.input_layernorm(hidden[0]).reshape(-1, 48)
    torch.testing.assert_close(inputs["self_attn.q_proj"], normed)
    assert inputs["mlp.down_proj"].shape == (60, 64) and inputs["self_attn.o_proj"].shape == (60, 48)
    runner.advance(layer)
    torch.testing.assert_close(torch.cat(runner.hidden), hidden[1])
    with pytest.raises(ValueError, match="not submodules"):
        runner.capture(layer, ["mlp.nope"])
    with pytest.raises(ValueError, match="batch_size"):
        BlockRunner(model, ids, batch_size=0)
    with pytest.raises(ValueError, match="n_samples, seq_len"):
        BlockRunner(model, ids[0])


# -- the whole model ------------------------------------------------------------------------------

def _calib():
    return torch.randint(0, 97, (8, 24), generator=torch.Generator().manual_seed(1))


def test_model_copy_and_error_below_rtn():
    from llmu.quant import QuantLinear, quantize_model

    model, ids = tiny_llama(0), _calib()
    before = copy.deepcopy(model.state_dict())
    ref = model(ids).logits
    q = quantize_model_gptq(model, ids, 3, group_size=16)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # untouched
    linears = [m for m in q.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 7 and all(m.qt.bits == 3 and m.qt.group_size == 16 for m in linears)
    rtn = quantize_model(model, "rtn", 3, group_size=16)
    err = lambda m: float(((m(ids).logits - ref) ** 2).mean())  # noqa: E731
    assert err(q) < err(rtn)
    # the same through quantize_model, and in place
    via = quantize_model(model, "gptq", 3, group_size=16, calibration=ids)
    torch.testing.assert_close(via(ids).logits, q(ids).logits)
    same = quantize_model_gptq(model, ids, 3, group_size=16, inplace=True)
    assert same is model and isinstance(model.layers[0].mlp.down_proj, QuantLinear)


def test_model_skip_and_bad_inputs():
    from llmu.models.llama import Linear
    from llmu.quant import QuantLinear

    model, ids = tiny_llama(0), _calib()
    q = quantize_model_gptq(model, ids, 4, group_size=16, skip=("down_proj", "layers.1.self_attn.q_proj"))
    assert isinstance(q.layers[0].mlp.down_proj, Linear) and isinstance(q.layers[1].self_attn.q_proj, Linear)
    assert isinstance(q.layers[0].self_attn.q_proj, QuantLinear)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_model_gptq(model, ids, 4, group_size=10)
    with pytest.raises(ValueError, match="bits"):
        quantize_model_gptq(model, ids, 6)
    with pytest.raises(TypeError, match="calibration"):
        quantize_model_gptq(model, torch.rand(4, 8), 4, group_size=16)
    with pytest.raises(TypeError, match="skip"):
        quantize_model_gptq(model, ids, 4, group_size=16, skip="down_proj")


@pytest.mark.slow
def test_smollm2_first_block(smollm2):
    # real activations of SmolLM2's first block: GPTQ beats RTN on every projection's output
    model, tok = smollm2
    ids = calibration_ids(torch.tensor(tok.encode("The river carries silt to the sea, and the delta grows. " * 20)),
                          n_samples=2, seq_len=64)
    runner = BlockRunner(model, ids)
    layer = model.layers[0]
    inputs = runner.capture(layer, [n for g in SEQUENTIAL_GROUPS for n in g])
    for name in ("self_attn.k_proj", "mlp.down_proj"):
        w, x = layer.get_submodule(name).weight, inputs[name]
        H, _ = hessian(x)
        gptq = output_error(w, dequantize(gptq_quantize(w, H, 3, group_size=64)), x)
        rtn = output_error(w, dequantize(quantize(w, 3, group_size=64)), x)
        assert gptq < rtn, name
