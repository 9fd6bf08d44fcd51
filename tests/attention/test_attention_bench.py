"""Module 02's benchmark entries: registered, formulas as documented, providers agree."""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.attention import bench
from llmu.bench.registry import REGISTRY, load_all

pytestmark = pytest.mark.kernels


def test_entries_are_registered():
    load_all()
    for name in ("softmax_temperature", "attention_naive"):
        entry = REGISTRY[name]
        assert entry.module == "02_attention"
        assert {p.kind for p in entry.providers.values()} == {"triton", "torch", "builtin"}
        assert entry.gpu_sizes and entry.cpu_sizes


def test_softmax_formulas():
    size = {"M": 2, "N": 10}
    assert bench.softmax_flops(size) == 6 * 20
    assert bench.softmax_bytes(size, 2) == 2 * 20 * 2


def test_attention_formulas():
    full = {"B": 2, "H": 4, "Hkv": 2, "T": 8, "D": 16, "causal": False}
    causal = dict(full, causal=True)
    assert bench.attention_flops(full) == 4 * 2 * 4 * 64 * 16
    # Causal: 8 queries see 1 + 2 + ... + 8 = 36 keys in all.
    assert bench.attention_flops(causal) == 4 * 2 * 4 * 36 * 16
    # q and output: 2*4*8*16 each; k and v: 2*2*8*16 each; fp32 scores written and read back.
    assert bench.attention_bytes(full, 2) == 2 * (2 * 1024 + 2 * 512) + 2 * 4 * 2 * 4 * 64


@pytest.mark.parametrize("name", ["softmax_temperature", "attention_naive"])
def test_providers_agree_on_the_smallest_cpu_size(name, kdev):
    entry = REGISTRY[name] if name in REGISTRY else load_all()[name]
    size = entry.cpu_sizes[0]
    inputs = entry.setup(size, kdev, torch.float32)
    outs = {pname: p.fn(*inputs) for pname, p in entry.providers.items()}
    ref = outs["llmu torch"]
    for pname, out in outs.items():
        # fp32 throughout; only the order of the sums differs between providers.
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=lambda m, pname=pname: f"{pname}: {m}")
