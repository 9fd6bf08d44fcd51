"""The ``kernels`` marker's guard (tests/conftest.py): meta is the default device inside those tests only.

A kernel test must name the device of every tensor it makes, or it could not run unchanged on a GPU
machine. The guard makes a forgotten device fail loudly: the tensor lands on ``meta``, which has no
values and which every launcher refuses.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def default_device_in_setup():
    return torch.empty(1).device.type


@pytest.mark.kernels
def test_a_kernels_test_gets_meta_by_default(default_device_in_setup):
    assert default_device_in_setup == "meta"        # fixtures too
    assert torch.empty(1).device.type == "meta"
    assert torch.empty(1, device="cpu").device.type == "cpu"  # a named device is kept


def test_other_tests_keep_cpu(default_device_in_setup):
    # runs after the test above: the guard has put torch's own default back
    assert default_device_in_setup == "cpu"
    assert torch.empty(1).device.type == "cpu"
