"""Module 13's Mamba block and tiny LM: decoding step by step == the full forward pass.

A block's ``step`` must reproduce ``forward`` position by position, from zero states and after a
prompt prefilled with ``forward(..., return_state=True)`` — shorter and longer than the
convolution's window, so that the conv state's zero padding is exercised. The three scans give
the same block output. Tolerance: float32 outputs of order 1 after the projections, computed with
the same operations in another order (the convolution as a dot product instead of ``conv1d``,
the scan as a loop or a prefix scan): ``1e-5``.

The time-invariant block (``selective=False``, the paper's S4-like ablation) must pass the same
checks, and its SSM must be exactly a causal convolution with the kernel ``K_j = Σ_n C_n Ā^j Δ B_n``
(computed here directly from its parameters).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from llmu.mamba.block import MambaBlock, MambaLM

pytestmark = pytest.mark.kernels

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=[True, False], ids=["selective", "time_invariant"])
def block(request):
    torch.manual_seed(0)
    with torch.device("cpu"):  # a module's parameters go on the default device: name it
        return MambaBlock(16, d_state=4, selective=request.param).eval()


def test_initialisation(block):
    E, N = block.d_inner, block.d_state
    assert (E, N, block.dt_rank, block.d_conv) == (32, 4, 1, 4)
    A = -torch.exp(block.A_log)
    torch.testing.assert_close(A, -torch.arange(1.0, N + 1, device="cpu").repeat(E, 1))     # S4D-real
    assert torch.equal(block.D.detach(), torch.ones(E, device="cpu"))
    dt = torch.nn.functional.softplus(block.delta_bias.detach())
    assert dt.shape == (E,) and dt.min() >= 1e-4 and dt.max() <= 0.1 + 1e-6  # Δ in [dt_min, dt_max]
    assert block.in_proj.bias is None and block.out_proj.bias is None and block.conv1d.bias is not None
    names = {name for name, _ in block.named_parameters()}
    if block.selective:
        assert tuple(block.x_proj.weight.shape) == (block.dt_rank + 2 * N, E)
        assert block.delta_bias is block.dt_proj.bias and not {"dt_bias", "B", "C"} & names
    else:
        # no projection computes Δ, B, C from the token: they are parameters of their own
        assert not any(name.startswith(("x_proj", "dt_proj")) for name in names)
        assert block.delta_bias is block.dt_bias
        assert block.B.shape == (N,) and block.C.shape == (N,)
        assert torch.equal(block.B.detach(), torch.ones(N, device="cpu"))


@pytest.mark.parametrize("impl", ["sequential", "triton"])
def test_scans_agree_in_the_block(block, impl, kdev):
    block = copy.deepcopy(block).to(kdev)   # the Triton scan takes its tensors on the kernel device
    x = torch.randn(2, 11, 16, generator=torch.Generator(device="cpu").manual_seed(1), device="cpu").to(kdev)
    with torch.no_grad():
        want, (conv_w, ssm_w) = block(x, return_state=True)
        got, (conv_g, ssm_g) = block(x, impl=impl, return_state=True)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(ssm_g, ssm_w, **TOL)
    assert torch.equal(conv_g, conv_w)


@pytest.mark.parametrize("prefix", [0, 1, 3, 4, 7])
def test_step_equals_forward(block, prefix):
    L = 9
    x = torch.randn(2, L, 16, generator=torch.Generator(device="cpu").manual_seed(2), device="cpu")
    with torch.no_grad():
        full, (conv_full, ssm_full) = block(x, return_state=True)
        if prefix:
            head, (conv, ssm) = block(x[:, :prefix], return_state=True)
            outs = [head]
        else:
            (conv, ssm), outs = block.allocate_state(2), []
        assert conv.shape == (2, 32, 4) and ssm.shape == (2, 32, 4) and ssm.dtype == torch.float32
        for t in range(prefix, L):
            y, conv, ssm = block.step(x[:, t], conv, ssm)
            outs.append(y[:, None])
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TOL)
    torch.testing.assert_close(ssm, ssm_full, **TOL)
    # the last d_conv inputs of the convolution (in_proj of one row vs of a sequence: last bits differ)
    torch.testing.assert_close(conv, conv_full, **TOL)


def test_step_accepts_a_length_one_sequence(block):
    x = torch.randn(2, 1, 16, device="cpu")
    conv, ssm = block.allocate_state(2)
    with torch.no_grad():
        y, _, _ = block.step(x, conv, ssm)
        assert y.shape == (2, 1, 16)
        torch.testing.assert_close(y, block(x), **TOL)


def test_block_is_causal_and_differentiable(block):
    x = torch.randn(1, 8, 16, device="cpu", requires_grad=True)
    out = block(x)
    out[0, 4].sum().backward()
    assert x.grad[0, 5:].abs().max() == 0 and x.grad[0, :5].abs().max() > 0
    assert block.A_log.grad is not None and block.delta_bias.grad is not None
    if not block.selective:
        assert block.B.grad is not None and block.C.grad is not None
    block.zero_grad()


def test_selection_is_what_differs(block):
    """Δ, B, C of a selective block change with the token; a time-invariant block's do not."""
    x = torch.randn(2, 5, block.d_inner, generator=torch.Generator(device="cpu").manual_seed(3), device="cpu")
    with torch.no_grad():
        dt, B, C = block._ssm_inputs(x)
    assert dt.shape == (2, 5, block.d_inner) and B.shape == C.shape == (2, 5, block.d_state)
    for t in (dt, B, C):
        same_everywhere = torch.equal(t, t[:1, :1].expand_as(t))
        assert same_everywhere != block.selective


def test_time_invariant_ssm_is_a_convolution():
    """selective=False: y = out_proj(((K * x) + D x) silu(z)) with one fixed causal kernel per
    channel, K_j[d] = Σ_n C_n exp(j Δ_d A_dn) Δ_d B_n, built here from the parameters."""
    torch.manual_seed(1)
    with torch.device("cpu"):
        blk = MambaBlock(8, d_state=3, selective=False).eval()
    with torch.no_grad():                              # give B, C, Δ values far from their init
        blk.B.copy_(torch.tensor([0.5, -1.0, 2.0], device="cpu"))
        blk.C.copy_(torch.tensor([1.0, 0.3, -0.7], device="cpu"))
        blk.dt_bias.add_(1.0)
    L = 10
    hidden = torch.randn(2, L, 8, generator=torch.Generator(device="cpu").manual_seed(4), device="cpu")
    with torch.no_grad():
        x, z = blk.in_proj(hidden).transpose(1, 2).chunk(2, dim=1)
        x = torch.nn.functional.silu(blk.conv1d(x)[..., :L])                 # (B, E, L)
        delta = torch.nn.functional.softplus(blk.dt_bias)                      # (E,)
        A = -torch.exp(blk.A_log)                                              # (E, N)
        lags = torch.arange(L, dtype=torch.float32, device="cpu")
        K = (blk.C * torch.exp(lags[:, None, None] * delta[:, None] * A) * delta[:, None] * blk.B).sum(-1)  # (L, E)
        y = torch.zeros_like(x)
        for t in range(L):
            for j in range(t + 1):
                y[..., t] += K[j] * x[..., t - j]
        y = (y + blk.D[:, None] * x) * torch.nn.functional.silu(z)
        want = blk.out_proj(y.transpose(1, 2))
        torch.testing.assert_close(blk(hidden), want, **TOL)


def test_selective_must_be_a_bool():
    with pytest.raises(TypeError, match="^selective must be a bool"):
        MambaBlock(8, selective="no")


def test_block_bad_inputs(block):
    with pytest.raises(ValueError, match="^impl must be one of"):
        block(torch.zeros(1, 3, 16, device="cpu"), impl="cuda")
    with pytest.raises(ValueError, match="^hidden must have shape"):
        block(torch.zeros(1, 3, 15, device="cpu"))


@pytest.mark.parametrize("selective", [True, False], ids=["selective", "time_invariant"])
def test_lm_step_equals_forward_and_generate(selective):
    torch.manual_seed(0)
    with torch.device("cpu"):
        lm = MambaLM(37, d_model=16, n_layers=2, d_state=4, selective=selective).eval()
    assert all(block.selective is selective for block in lm.blocks)
    ids = torch.randint(0, 37, (2, 7), device="cpu")
    with torch.no_grad():
        logits = lm(ids)
        assert logits.shape == (2, 7, 37)
        states, steps = lm.allocate_state(2), []
        for t in range(7):
            lt, states = lm.step(ids[:, t], states)
            steps.append(lt)
        torch.testing.assert_close(torch.stack(steps, dim=1), logits, **TOL)
        out = lm.generate(ids[:, :3], 4)
    assert out.shape == (2, 7) and torch.equal(out[:, :3], ids[:, :3])
    # greedy generation continues with the argmax of the full forward pass at every position
    with torch.no_grad():
        full = lm(out)
    assert torch.equal(full[:, 2:-1].argmax(-1), out[:, 3:])
    assert lm.head(torch.zeros(1, 16, device="cpu")).shape == (1, 37)
    assert not any("head" in name for name, _ in lm.named_parameters())          # tied: no own weights


def test_lm_learns_a_pattern_on_cpu():
    """A few steps of Adam on a repeating sequence: the loss drops well below log(V)."""
    torch.manual_seed(0)
    V = 11
    with torch.device("cpu"):
        lm = MambaLM(V, d_model=32, n_layers=1, d_state=8)
    ids = torch.arange(48, device="cpu").remainder(V)[None].repeat(4, 1)
    opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
    for _ in range(30):
        logits = lm(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * math.log(V)
