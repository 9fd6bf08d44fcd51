"""pytest plugin that ``benchmarks/gpu.sh`` loads (``-p llmu_gpu_pytest``) for the kernel tests.

The kernel tests are written once, for a laptop: on a GPU machine llmu compiles the kernels and
its launchers want CUDA tensors. This plugin makes CUDA the default device for the test session,
so tensors a test creates without naming a device land on the GPU and reach the compiled kernels.
Tests that name a device, or build tensors from a CPU ``torch.Generator``, keep theirs; the
robust way for a test is to ask ``llmu.runtime.kernel_device()``. Without CUDA it does nothing.
"""

import torch


def pytest_configure(config):
    if torch.cuda.is_available():
        torch.set_default_device("cuda")
        config.stash_llmu_default_device = "cuda"


def pytest_report_header(config):
    device = getattr(config, "stash_llmu_default_device", None)
    return f"llmu_gpu_pytest: default torch device {device or 'unchanged (no CUDA)'}"
