"""The course's real model: SmolLM2-135M-Instruct, a Llama-family decoder built from llmu's parts.

>>> from llmu.models import load_model, load_tokenizer, generate
>>> model, tok = load_model(), load_tokenizer()
>>> print(generate(model, tok, [{"role": "user", "content": "What is the capital of France?"}]))
The capital of France is Paris.

- ``gguf_file``: find and read the GGUF file (metadata, tensors as stored);
- ``quants`` / ``kernels``: Q8_0 and Q4_1 dequantization in torch and in Triton;
- ``tokenizer``: byte-level BPE from the file's metadata, and the ChatML chat format;
- ``llama``: the decoder (``LlamaModel``) with pluggable attention, KV cache and weight format;
- ``loading`` / ``hf_loader``: weights from the GGUF file, or from Hugging Face safetensors;
- ``sampling`` / ``generate``: logits processors and the decoding loop.
"""

from llmu.models.backends import attention_backends, get_attention_backend, register_attention_backend
from llmu.models.cache import KVCache
from llmu.models.config import LlamaConfig, byte_llama_config
from llmu.models.generate import Generation, GenerationStats, generate, generate_ids, stream_generate
from llmu.models.gguf_file import GGUFFile, model_path
from llmu.models.hf_loader import load_hf_checkpoint
from llmu.models.llama import Linear, LlamaModel, ModelOutput, make_trainable, tiny_llama
from llmu.models.loading import load_model
from llmu.models.quants import dequantize
from llmu.models.sampling import SamplingParams

# The tokenizer needs the `tokenizers` library, which kernel and benchmark code does not: a GPU
# machine with only torch and Triton still imports llmu.models (llmu.flash, llmu.paged and
# llmu.scale build on it). `Tokenizer` and `load_tokenizer` are imported on first use.
_LAZY = {"Tokenizer": "llmu.models.tokenizer", "load_tokenizer": "llmu.models.tokenizer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GGUFFile",
    "Generation",
    "GenerationStats",
    "SamplingParams",
    "KVCache",
    "Linear",
    "LlamaConfig",
    "LlamaModel",
    "ModelOutput",
    "Tokenizer",
    "attention_backends",
    "byte_llama_config",
    "dequantize",
    "generate",
    "generate_ids",
    "stream_generate",
    "get_attention_backend",
    "load_hf_checkpoint",
    "load_model",
    "load_tokenizer",
    "model_path",
    "register_attention_backend",
    "tiny_llama",
    "make_trainable",
]
