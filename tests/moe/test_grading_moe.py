"""llmu.grading.moe: the layout-free checks of notebook 12's exercise 6 (the learner's MoE layer)."""

from __future__ import annotations

import sys

import pytest
import torch

from llmu.grading.moe import notebook_lines, sorted_values


def test_sorted_values_ignore_the_layout():
    g = torch.Generator().manual_seed(0)
    w_gate, w_up = torch.randn(3, 5, 4, generator=g), torch.randn(3, 5, 4, generator=g)
    fused_transposed = torch.cat([w_gate, w_up], dim=1).transpose(1, 2)     # (E, H, 2F), another layout
    a = sorted_values([w_gate, w_up])
    assert a.dtype == torch.float64 and a.shape == (120,)
    assert torch.equal(a, sorted_values([fused_transposed]))
    assert (a[1:] >= a[:-1]).all()
    assert not torch.equal(a, sorted_values([w_gate, w_up * 1.001]))


def test_sorted_values_are_as_close_as_the_values_in_any_order():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, generator=g, dtype=torch.float64)
    noisy = x + 1e-9 * torch.randn(50, generator=g, dtype=torch.float64)
    perm = torch.randperm(50, generator=g)
    assert (sorted_values([noisy[perm]]) - sorted_values([x])).abs().max() <= 1e-9 * 5


def test_sorted_values_count_a_missing_gradient_as_zeros():
    params = [torch.ones(2, 3), torch.ones(4)]
    out = sorted_values([None, torch.full((4,), 2.0)], like=params)
    assert out.tolist() == [0.0] * 6 + [2.0] * 4
    with pytest.raises(ValueError, match="like="):
        sorted_values([None, torch.ones(4)])
    with pytest.raises(ValueError, match="one tensor per entry"):
        sorted_values([None], like=params)
    with pytest.raises(TypeError, match="tensors\\[0\\]"):
        sorted_values([[1.0, 2.0]])
    assert sorted_values([]).numel() == 0


def _namespace():
    ns: dict = {"torch": torch}
    exec(  # noqa: S102 - a stand-in for notebook cells: code whose globals are this dict
        "def helper(v):\n"
        "    return v * 2\n"
        "class Looped:\n"
        "    def run(self, x):\n"
        "        out = []\n"
        "        for row in x.tolist():\n"
        "            out.append(helper(row))\n"
        "        return out\n"
        "class Vectorised:\n"
        "    def run(self, x):\n"
        "        return helper(x).sum()\n",
        ns)
    return ns


def test_notebook_lines_grow_with_a_python_loop_only():
    ns = _namespace()
    looped, vectorised = ns["Looped"](), ns["Vectorised"]()
    few, many = torch.arange(4.0), torch.arange(40.0)
    result, n_few = notebook_lines(lambda: looped.run(few), ns["Looped"])
    assert result == [0.0, 2.0, 4.0, 6.0]
    _, n_many = notebook_lines(lambda: looped.run(many), ns["Looped"])
    assert n_many - n_few >= 2 * 36          # the loop's two lines per item, the helper's line too
    _, v_few = notebook_lines(lambda: vectorised.run(few), ns["Vectorised"])
    _, v_many = notebook_lines(lambda: vectorised.run(many), ns["Vectorised"])
    assert v_few == v_many > 0               # its own line and the helper's: the same for any size


def test_notebook_lines_count_only_the_home_namespace_and_restore_the_tracer():
    ns = _namespace()
    # torch's and this file's code run too, but only the notebook's lines count
    _, n = notebook_lines(lambda: torch.nn.functional.silu(torch.ones(3)), ns["helper"])
    assert n == 0
    previous = sys.gettrace()
    notebook_lines(lambda: ns["helper"](1), ns["helper"])
    assert sys.gettrace() is previous
    with pytest.raises(TypeError, match="home must be"):
        notebook_lines(lambda: None, 3)
    with pytest.raises(TypeError, match="call must be"):
        notebook_lines(None, ns["helper"])
