"""Build a :class:`LlamaModel` from the course's GGUF file.

Names: GGUF calls the tensors ``token_embd``, ``blk.{i}.attn_q``, ``blk.{i}.ffn_gate``,
``output_norm``, ...; they map one to one onto the Hugging Face names the model uses
(:data:`GGUF_TO_HF`).

Values: the Q4_1 and Q8_0 blocks are dequantized to float32 with ``llmu.models.quants`` (equal bit
for bit to the ``gguf`` package), then cast to the requested dtype. The dense weights of the model
are therefore exactly the Q4_1 values of the file; that is the reference module 10 starts from.

RoPE layout: llama.cpp rotates *interleaved* pairs (channels ``2i``, ``2i+1``), Hugging Face
rotates *halves* (``i``, ``i + D/2``). To make one layout compute what the other computed in
training, llama.cpp's converter reorders the rows of ``attn_q`` and ``attn_k`` inside every head:
HF row ``h * D/2 + i`` (``h`` = which half) is stored as row ``2i + h``. Any consistent reordering
of a head's channels in both ``q`` and ``k`` leaves ``q . k`` unchanged, so there are two correct
ways to run the file: keep the stored order and rotate interleaved pairs, or undo the reordering
and rotate halves. llmu undoes it (:func:`unpermute_rope_rows`) and uses ``"half"``: the weights
are then identical to those of the Hugging Face checkpoint, row for row, and RoPE is the one of
``llmu.layers``. Keeping the stored rows with ``"half"`` is wrong (a test shows the logits change).

Caching: parsing the file and dequantizing take seconds, and give the same weights every time.
:func:`load_model` therefore writes them once to a safetensors file (:mod:`llmu.models.weight_cache`)
and later maps that file; :data:`LOADER_VERSION` is part of its key.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from llmu.models import weight_cache
from llmu.models.backends import get_attention_backend
from llmu.models.config import LlamaConfig
from llmu.models.gguf_file import GGUFFile, model_path
from llmu.models.llama import LlamaModel

#: Version of what this module makes of a GGUF file. Bump it whenever the weights it produces
#: change (dequantization, RoPE row order, names, dtype casts): the weight files that
#: :func:`load_model` cached are keyed by it, so those of an older loader are then not used.
LOADER_VERSION = 1

#: GGUF tensor name pattern -> Hugging Face / llmu parameter name
GGUF_TO_HF = {
    r"token_embd\.weight": "embed_tokens.weight",
    r"output_norm\.weight": "norm.weight",
    r"output\.weight": "lm_head.weight",
    r"blk\.(\d+)\.attn_norm\.weight": r"layers.\1.input_layernorm.weight",
    r"blk\.(\d+)\.attn_q\.weight": r"layers.\1.self_attn.q_proj.weight",
    r"blk\.(\d+)\.attn_k\.weight": r"layers.\1.self_attn.k_proj.weight",
    r"blk\.(\d+)\.attn_v\.weight": r"layers.\1.self_attn.v_proj.weight",
    r"blk\.(\d+)\.attn_output\.weight": r"layers.\1.self_attn.o_proj.weight",
    r"blk\.(\d+)\.ffn_norm\.weight": r"layers.\1.post_attention_layernorm.weight",
    r"blk\.(\d+)\.ffn_gate\.weight": r"layers.\1.mlp.gate_proj.weight",
    r"blk\.(\d+)\.ffn_up\.weight": r"layers.\1.mlp.up_proj.weight",
    r"blk\.(\d+)\.ffn_down\.weight": r"layers.\1.mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str:
    """The llmu / Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj.weight``)."""
    for pattern, target in GGUF_TO_HF.items():
        if re.fullmatch(pattern, gguf_name):
            return re.sub(pattern, target, gguf_name)
    raise KeyError(f"no llmu name for GGUF tensor {gguf_name!r}")


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face row order -> llama.cpp's (what the GGUF converter did to ``attn_q``/``attn_k``)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp row order -> Hugging Face's: inside each head, rows ``0, 2, 4, ..`` then ``1, 3, 5, ..``."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_state_dict(f: GGUFFile, *, unpermute: bool = True, dtype=torch.float32):
    """Yield ``(llmu_name, tensor)`` for every tensor of the file, dequantized (one at a time)."""
    config = f.config
    for name in f.tensor_names():
        w = f.tensor(name).dequantize()
        target = hf_name(name)
        if unpermute and target.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, config.num_attention_heads)
        elif unpermute and target.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, config.num_key_value_heads)
        yield target, w.to(dtype)


def build_from_gguf(path=None, *, dtype=torch.float32, device=None, attention: str = "sdpa",
                    rope_layout: str = "half") -> LlamaModel:
    """Read a llama GGUF into a new :class:`LlamaModel` (no caching; see :func:`load_model`).

    ``rope_layout="interleaved"`` keeps llama.cpp's row order and rotates interleaved pairs: the
    same model, computed the other way (used by the tests to show both are right).
    """
    if rope_layout not in ("half", "interleaved"):
        raise ValueError(f"rope_layout must be 'half' or 'interleaved', got {rope_layout!r}")
    with GGUFFile(path) as f:
        config = f.config
        config.rope_layout = rope_layout
        state = {name: w.to(device) for name, w in
                 gguf_state_dict(f, unpermute=rope_layout == "half", dtype=dtype)}
    model = assemble(config, state, dtype=dtype, attention=attention, source="the GGUF file")
    del state
    _release_freed_memory()
    return model


def assemble(config: LlamaConfig, state: dict[str, torch.Tensor], *, dtype=torch.float32, device=None,
             attention: str = "sdpa", source: str = "the weights") -> LlamaModel:
    """A :class:`LlamaModel` whose parameters *are* the tensors of ``state`` (moved to ``device``).

    The skeleton is built on the "meta" device, which allocates nothing; the tensors are then
    assigned as the parameters (no random initialisation, no second copy). With tied embeddings
    ``state`` holds no ``lm_head.weight`` and the head is the embedding matrix itself. A tensor
    missing from ``state``, or of another shape, raises ``ValueError`` naming ``source``.
    """
    with torch.device("meta"), _SkipInit():
        model = LlamaModel(config, attention=attention, dtype=dtype)
    expected = dict(model.named_parameters(remove_duplicate=False))
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{source} has no weights for {missing[:5]}")
    for name, p in expected.items():
        if state[name].shape != p.shape:
            raise ValueError(f"{source} has {name} of shape {tuple(state[name].shape)}, expected {tuple(p.shape)}")
    if device is not None:
        state = {name: w.to(device) for name, w in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.requires_grad_(False)
    return model.eval()


class _SkipInit(TorchFunctionMode):
    """Skip ``torch.nn.init`` while a skeleton is built on the meta device: its values would be
    replaced anyway, and random numbers on "meta" make torch import its compiler (2 s, once)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def load_weights(path=None, *, dtype=torch.float32, device=None, attention: str = "sdpa"
                 ) -> tuple[LlamaModel, str]:
    """The model of a GGUF file through the weight cache (:mod:`llmu.models.weight_cache`), and
    where its weights came from: ``"cache"`` or ``"gguf"``.

    The first time (per file content, :data:`LOADER_VERSION` and dtype) the file is dequantized
    as by :func:`build_from_gguf` and the weights are written to the cache; later the cached file
    is mapped (no GGUF parsing, no dequantization) and the model built from the config stored
    beside the weights. A damaged cache file is rebuilt; a cache that cannot be written is
    skipped; each with one warning. Either way the weights are the same, bit for bit.
    """
    gguf = Path(path) if path is not None else model_path()
    sha = weight_cache.file_sha256(gguf)
    key = dict(sha256=sha, dtype=dtype, loader_version=LOADER_VERSION)
    file = weight_cache.cache_file(sha, dtype, LOADER_VERSION)
    cached = weight_cache.read(file, **key)
    if cached is not None:
        try:
            return assemble(*cached, dtype=dtype, device=device, attention=attention, source=str(file)), "cache"
        except ValueError as exc:  # a file that another llmu wrote under the same key
            weight_cache.warn_damaged(file, str(exc))
    with GGUFFile(gguf) as f:
        config = f.config
        state = dict(gguf_state_dict(f, dtype=dtype))
    if weight_cache.write(file, state, config, **key):
        # map what was just written: the same bits, held as file pages that other processes share
        cached = weight_cache.read(file, **key)
        if cached is not None:
            config, state = cached
    model = assemble(config, state, dtype=dtype, device=device, attention=attention, source=str(gguf))
    del state, cached
    _release_freed_memory()
    return model, "gguf"


def _release_freed_memory() -> None:
    """Hand the temporaries of dequantization back to the OS (glibc keeps freed heap otherwise),
    so that the process's memory after loading is the model, not the model plus its scratch."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, Windows): nothing to do
        pass


_CACHE: dict[tuple, LlamaModel] = {}
_LOCK = threading.Lock()
#: seconds the last load that read weights took (``fresh=True`` or the first of a dtype and device)
LAST_LOAD_S: float | None = None
#: where those weights came from: ``"cache"`` (the weight cache on disk) or ``"gguf"`` (dequantized)
LAST_LOAD_SOURCE: str | None = None


def _share_weights(src: LlamaModel, attention: str) -> LlamaModel:
    """A second model object over the *same* weight tensors, with its own attention backend."""
    with torch.device("meta"), _SkipInit():
        twin = LlamaModel(src.config, attention=attention, dtype=src.dtype)
    twin.load_state_dict(src.state_dict(), assign=True)
    if src.config.tie_word_embeddings:
        twin.lm_head.weight = twin.embed_tokens.weight
    twin.requires_grad_(False)
    return twin.eval()


def load_model(dtype: torch.dtype = torch.float32, device=None, attention: str = "sdpa", *,
               path: str | Path | None = None, fresh: bool = False) -> LlamaModel:
    """SmolLM2-135M-Instruct as a :class:`LlamaModel`, from the GGUF file (Q4_1 values, dequantized).

    Loaded once per process and kept: calling it again with the same ``dtype``, ``device`` and
    ``attention`` returns the *same* object; with another ``attention`` it returns a second model
    that shares the weight tensors (no extra memory). Changing weights in place therefore shows
    in every copy; ``fresh=True`` gives an independent model that is not cached (for exercises
    that modify weights). The weights do not require gradients; call ``requires_grad_()`` to train.
    Across processes the dequantized weights are kept on disk (:func:`load_weights`): the first
    load of a dtype takes seconds, later ones a fraction of one (``llmu doctor`` says where the
    cache is and how big; ``LLMU_CACHE`` moves it).
    The first call lowers torch's CPU threads to the CPUs the process may use, unless
    ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` is set (:func:`llmu.runtime.configure_threads`).
    """
    from llmu import runtime

    get_attention_backend(attention)  # an unknown name fails before anything is read
    device = torch.device(device) if device is not None else runtime.device()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    path = Path(path) if path is not None else None
    runtime.configure_threads()  # once per process: no more torch threads than CPUs we may use
    if fresh:
        with _LOCK:  # one load at a time: each needs the memory of a whole model while it runs
            return _load(path, dtype, device, attention)
    key = (str(path), dtype, str(device))
    with _LOCK:
        base = _CACHE.get(key)
        if base is None:
            base = _load(path, dtype, device, attention)
            _CACHE[key] = base
            _CACHE[key + (attention,)] = base
        model = _CACHE.get(key + (attention,))
        if model is None:
            model = _CACHE[key + (attention,)] = _share_weights(base, attention)
    return model


def _load(path, dtype, device, attention) -> LlamaModel:
    """:func:`load_weights`, timed in :data:`LAST_LOAD_S` and :data:`LAST_LOAD_SOURCE`."""
    global LAST_LOAD_S, LAST_LOAD_SOURCE
    start = time.perf_counter()
    model, LAST_LOAD_SOURCE = load_weights(path, dtype=dtype, device=device, attention=attention)
    LAST_LOAD_S = time.perf_counter() - start
    return model


def clear_cache() -> None:
    """Forget the cached models (their memory is freed once nothing else refers to them)."""
    _CACHE.clear()
