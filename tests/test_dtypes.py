"""llmu.runtime's dtype helpers: bf16 only where the GPU has it (compute capability 8.0 on: A100,
H100, H200), fp16 on a T4 (7.5), float32 on a CPU. The GPU is faked by monkeypatching torch.cuda,
so these run on any machine."""

from __future__ import annotations

import pytest
import torch

from llmu import runtime


@pytest.fixture
def gpu(monkeypatch):
    """Pretend this machine has one CUDA GPU of the compute capability passed to the returned function."""
    def set_capability(major: int, minor: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
    return set_capability


@pytest.mark.parametrize("capability, dtype", [
    ((7, 5), torch.float16),    # T4, Colab's free GPU
    ((8, 0), torch.bfloat16),   # A100
    ((8, 9), torch.bfloat16),   # L4
    ((9, 0), torch.bfloat16),   # H100, H200
])
def test_preferred_dtype_on_a_gpu(gpu, capability, dtype):
    gpu(*capability)
    assert runtime.preferred_dtype() == dtype               # the default device is the GPU
    assert runtime.preferred_dtype("cuda") == dtype
    assert runtime.half_dtype("cuda") == dtype
    assert runtime.supports_bf16("cuda") is (dtype == torch.bfloat16)


def test_a_cpu_computes_in_float32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.device().type == "cpu"
    assert runtime.preferred_dtype() == torch.float32
    assert runtime.preferred_dtype("cpu") == torch.float32
    assert runtime.half_dtype() == torch.bfloat16            # CPUs have bf16 (fp16 matmuls are slow there)
    assert runtime.supports_bf16("cpu") is True


def test_a_cpu_device_ignores_the_gpu(gpu):
    gpu(7, 5)
    assert runtime.preferred_dtype(torch.device("cpu")) == torch.float32
    assert runtime.half_dtype("cpu") == torch.bfloat16
