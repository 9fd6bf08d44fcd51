"""Module 00 benchmark entries: formulas and providers agree with each other."""

from __future__ import annotations

import pytest
import torch

from llmu.bench.registry import REGISTRY, load_all

pytestmark = pytest.mark.kernels


def test_welcome_entries_registered_with_formulas():
    load_all()
    add, sm = REGISTRY["vector_add"], REGISTRY["softmax_rows"]
    assert add.flops({"N": 1000}) == 1000
    assert add.bytes({"N": 1000}, 2) == 6000
    assert sm.flops({"M": 4, "N": 10}) == 200
    assert sm.bytes({"M": 4, "N": 10}, 4) == 320
    assert {p.kind for p in sm.providers.values()} == {"triton", "torch", "builtin"}


def test_welcome_providers_agree_on_small_sizes(kdev):
    load_all()
    for name, size in (("vector_add", {"N": 3000}), ("softmax_rows", {"M": 5, "N": 300})):
        entry = REGISTRY[name]
        inputs = entry.setup(size, kdev, torch.float32)
        results = [p.fn(*inputs) for p in entry.providers.values()]
        for r in results[1:]:
            torch.testing.assert_close(r, results[0], atol=1e-6, rtol=1e-5)
