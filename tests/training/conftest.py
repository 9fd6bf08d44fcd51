"""Fixtures the training tests share."""

from __future__ import annotations

import pytest

from llmu.bench.machine import Threads


@pytest.fixture
def one_thread():
    """Bit-exact comparisons need one summation order: one intra-op thread while the test runs."""
    with Threads(1):
        yield
