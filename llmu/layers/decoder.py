"""A trainable Llama decoder of plain torch modules: llmu's answer to notebook 03's capstone.

``llmu.models.LlamaModel`` is built for inference: pluggable attention backends, caches, weight
formats. :class:`DecoderLM` is the same network with none of that, the size of a page, in the
shape notebook 03's last exercise asks for::

    DecoderLM(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff,
              rope_base=10000.0, eps=1e-5, tie_embeddings=False)
    DecoderLM(...)(ids)          # ids (B, T) integers -> logits (B, T, vocab_size), float32

Its parts, each a module: :class:`Linear` (no bias) and :class:`Embedding`, whose weights start
as ``N(0, 0.02²)`` (GPT-2's initialisation, also ``llmu.models.make_trainable``'s); :class:`RMSNorm`
with a gain of ones; :class:`Rotary`, which rotates pairs ``(i, i + D/2)`` of every head
(``"half"``, the layout of Hugging Face's checkpoints and of llmu's loaded models) by ``m · θᵢ``,
``θᵢ = rope_base^(-2i/D)``; :class:`Attention`, grouped-query attention, ``n_heads`` query heads
sharing ``n_kv_heads`` key/value heads (query head ``h`` reads KV head ``h // (n_heads /
n_kv_heads)``), causal; :class:`MLP`, SwiGLU; :class:`Block`, pre-norm; :class:`DecoderLM`.
``head_dim = d_model / n_heads``. With ``tie_embeddings`` the output head *is* the embedding
matrix (one parameter).

:func:`load_llmu_weights` is the mapping from llmu's (Hugging Face's) parameter names to these
modules: it copies the weights of an llmu ``LlamaModel`` (SmolLM2 from the GGUF file, or any
decoder of the same shape) into a :class:`DecoderLM`. :func:`decoder_args` gives the arguments of
the :class:`DecoderLM` that has a ``LlamaConfig``'s shape.

Its norm and rotation are notebook 03's functions (``llmu.layers.reference``); nothing here imports
``llmu.models``, which builds on ``llmu.layers``. How the notebook grades a learner's decoder, and
trains it, is :mod:`llmu.grading.decoder`.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from llmu.layers.reference import apply_rope, rms_norm, rope_angles

__all__ = ["Linear", "Embedding", "RMSNorm", "Rotary", "Attention", "MLP", "Block", "DecoderLM",
           "load_llmu_weights", "decoder_args", "INIT_STD"]

#: The standard deviation every matrix starts with.
INIT_STD = 0.02


class Linear(nn.Module):
    """``y = x W^T``, ``W`` ``(out_features, in_features)`` drawn from ``N(0, 0.02²)``; no bias."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) * INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class Embedding(nn.Module):
    """A table of ``num`` vectors of ``dim`` numbers, drawn from ``N(0, 0.02²)``; ``forward(ids)`` looks them up."""

    def __init__(self, num: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num, dim) * INIT_STD)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · w`` over the last dimension, ``w`` starting at ones."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embeddings, ``"half"`` layout: pair ``i`` of a head is channels ``(i, i + D/2)``,
    turned by ``m · base^(-2i/D)`` at position ``m``. Holds no parameters."""

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        self.head_dim, self.base = head_dim, base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, H, T, D)``, rotated by positions ``0 .. T-1``."""
        cos, sin = rope_angles(torch.arange(x.shape[-2], device=x.device), self.head_dim, self.base)
        return apply_rope(x, cos.to(x.dtype), sin.to(x.dtype), "half")


class Attention(nn.Module):
    """Causal grouped-query self-attention: ``n_heads`` query heads, ``n_kv_heads`` key/value heads."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, rope_base: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.q_proj = Linear(d_model, n_heads * self.head_dim)
        self.k_proj = Linear(d_model, n_kv_heads * self.head_dim)   # narrower than q: the KV heads are shared
        self.v_proj = Linear(d_model, n_kv_heads * self.head_dim)
        self.o_proj = Linear(n_heads * self.head_dim, d_model)
        self.rotary = Rotary(self.head_dim, rope_base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)       # (B, H, T, D)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)    # (B, Hkv, T, D)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q), self.rotary(k)
        group = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)      # head h reads KV head h // group
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)                      # (B, H, T, T)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(-1)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) · up(x))``."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate_proj, self.up_proj = Linear(d_model, d_ff), Linear(d_model, d_ff)
        self.down_proj = Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, d_model, n_heads, n_kv_heads, d_ff, rope_base, eps):
        super().__init__()
        self.input_layernorm = RMSNorm(d_model, eps)
        self.self_attn = Attention(d_model, n_heads, n_kv_heads, rope_base)
        self.post_attention_layernorm = RMSNorm(d_model, eps)
        self.mlp = MLP(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class DecoderLM(nn.Module):
    """A Llama-family decoder: embeddings, ``n_layers`` blocks, a final RMSNorm, the output head.

    ``ValueError`` when a size is not a positive int, when ``d_model`` is not a multiple of
    ``n_heads``, when ``n_heads`` is not a multiple of ``n_kv_heads``, when the head size is odd
    (RoPE turns pairs), or when ``rope_base`` or ``eps`` is not a number > 0.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int,
                 rope_base: float = 10000.0, eps: float = 1e-5, tie_embeddings: bool = False):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("d_model", d_model), ("n_layers", n_layers),
                            ("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("d_ff", d_ff)):
            positive_int(name, value)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if (d_model // n_heads) % 2:
            raise ValueError(f"the head size d_model / n_heads = {d_model // n_heads} must be even for RoPE")
        for name, value in (("rope_base", rope_base), ("eps", eps)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        self.embed_tokens = Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(Block(d_model, n_heads, n_kv_heads, d_ff, rope_base, eps)
                                    for _ in range(n_layers))
        self.norm = RMSNorm(d_model, eps)
        self.lm_head = Linear(d_model, vocab_size)
        if tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight   # one parameter, two uses

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for ``ids`` ``(B, T)``."""
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.is_floating_point():
            raise ValueError(f"ids must be a (B, T) integer tensor, got {getattr(ids, 'shape', type(ids).__name__)}")
        x = self.embed_tokens(ids)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def load_llmu_weights(lm: DecoderLM, model) -> DecoderLM:
    """Copy the weights of the llmu ``LlamaModel`` ``model`` into ``lm`` (in place; returns ``lm``).

    ``model`` must use the ``"half"`` RoPE layout (every model llmu loads does) and have ``lm``'s
    shape; a tied ``lm`` takes the embedding matrix once. The modules above carry llmu's names
    (``layers.{i}.self_attn.q_proj.weight``, ...), so the mapping is name for name. ``ValueError``
    names the first weight whose shape differs or that ``lm`` lacks.
    """
    if getattr(model, "config", None) is None or not hasattr(model, "layers"):
        raise TypeError(f"model must be an llmu LlamaModel, got {type(model).__name__}")
    if model.config.rope_layout != "half" or model.config.position_embedding != "rope":
        raise ValueError("model must rotate q and k with the 'half' RoPE layout")
    mine = dict(lm.named_parameters())          # a tied lm lists the embedding once, as embed_tokens.weight
    with torch.no_grad():
        for name, src in model.named_parameters():
            if name not in mine:
                raise ValueError(f"the DecoderLM has no parameter {name!r}")
            if mine[name].shape != src.shape:
                raise ValueError(f"{name}: the DecoderLM's is {tuple(mine[name].shape)}, the model's {tuple(src.shape)}")
            mine[name].copy_(src)
    return lm


def decoder_args(config) -> dict:
    """The :class:`DecoderLM` arguments (a dict) of a decoder of an llmu ``LlamaConfig``'s shape."""
    c = config
    if c.head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError(f"a DecoderLM's heads split d_model: head_dim {c.head_dim} x {c.num_attention_heads} heads "
                         f"!= hidden_size {c.hidden_size}")
    return dict(vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers,
                n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads, d_ff=c.intermediate_size,
                rope_base=float(c.rope_theta), eps=float(c.rms_norm_eps), tie_embeddings=bool(c.tie_word_embeddings))
