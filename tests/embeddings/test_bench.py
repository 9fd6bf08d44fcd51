"""Module 01 benchmark entry: formulas and providers agree."""

import torch

from llmu.bench.registry import REGISTRY, load_all


def test_cosine_entry():
    load_all()
    e = REGISTRY["cosine_similarity"]
    s = {"Q": 2, "V": 10, "D": 4}
    assert e.flops(s) == 160
    assert e.bytes(s, 2) == (8 + 40 + 20) * 2
    inputs = e.setup({"Q": 3, "V": 50, "D": 24}, "cpu", torch.float32)
    results = [p.fn(*inputs) for p in e.providers.values()]
    for r in results[1:]:
        torch.testing.assert_close(r, results[0], atol=1e-6, rtol=0)
