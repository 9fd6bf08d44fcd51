"""The module's benchmark entries: registered, their providers compute the same thing, and their
cost formulas are the documented ones."""

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench.registry import REGISTRY
from llmu.layers import bench  # noqa: F401  (registers the entries)

pytestmark = pytest.mark.kernels

NAMES = ["rms_norm", "rms_norm_bwd", "rope", "swiglu", "swiglu_bwd"]
TINY = {  # small enough for the interpreter, ragged on purpose
    "rms_norm": {"M": 5, "N": 72}, "rms_norm_bwd": {"M": 37, "N": 72},
    "rope": {"B": 2, "T": 5, "Hq": 3, "Hk": 1, "D": 16},
    "swiglu": {"M": 3, "N": 1100}, "swiglu_bwd": {"M": 3, "N": 1100},
}


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


@pytest.mark.parametrize("name", NAMES)
def test_entry_registered_with_sizes_and_providers(name):
    e = REGISTRY[name]
    assert e.module == "03_rope_swiglu_rmsnorm"
    assert e.gpu_sizes and e.cpu_sizes and e.x_axis in e.cpu_sizes[0]
    kinds = {p.kind for p in e.providers.values()}
    assert "triton" in kinds and "torch" in kinds
    for s in e.gpu_sizes + e.cpu_sizes:
        assert e.flops(s) > 0 and e.bytes(s, 2) > 0
        assert e.bytes(s, 4) > e.bytes(s, 2)  # traffic scales with the element size


@pytest.mark.parametrize("name", NAMES)
def test_providers_agree(name, kdev):
    e = REGISTRY[name]
    size = TINY[name]
    results = {}
    for label, p in e.providers.items():
        inputs = e.setup(size, kdev, torch.float32)  # fresh inputs: rope works in place
        results[label] = [t.detach().clone() for t in _flat(p.fn(*inputs))]
    first = next(iter(results.values()))
    for label, out in results.items():
        assert len(out) == len(first), label
        for a, b in zip(out, first):
            # fp32 on both sides; sums in a different order (dw over 37 rows): 1e-4.
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, name=name, label=label: f"{name}/{label}: {m}")


def test_formulas():
    s = {"M": 10, "N": 100}
    assert REGISTRY["rms_norm"].bytes(s, 2) == (2 * 10 * 100 + 100) * 2
    assert REGISTRY["swiglu"].bytes(s, 2) == 3 * 10 * 100 * 2
    assert REGISTRY["swiglu_bwd"].bytes(s, 4) == 5 * 10 * 100 * 4
    r = {"B": 2, "T": 8, "Hq": 9, "Hk": 3, "D": 64}
    assert REGISTRY["rope"].bytes(r, 2) == 2 * 2 * 8 * 12 * 64 * 2 + 8 * 64 * 4
    assert REGISTRY["rope"].flops(r) == 3 * 2 * 8 * 12 * 64
