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
from llmu.models.config import LlamaConfig
from llmu.models.generate import Generation, GenerationStats, generate, generate_ids, stream_generate
from llmu.models.gguf_file import GGUFFile, model_path
from llmu.models.hf_loader import load_hf_checkpoint
from llmu.models.llama import Linear, LlamaModel, ModelOutput, make_trainable, tiny_llama
from llmu.models.loading import load_model
from llmu.models.quants import dequantize
from llmu.models.sampling import SamplingParams
from llmu.models.tokenizer import Tokenizer, load_tokenizer

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
