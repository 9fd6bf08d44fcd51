"""Training FLOPs of a decoder: ``6·N·D``, and what attention adds.

**Why 6.** A weight matrix ``W`` ``(K, M)`` that multiplies ``x`` ``(K,)`` does ``K·M`` multiplies
and ``K·M`` adds: 2 FLOPs per parameter per token in the forward pass. The backward pass does two
matmuls per forward matmul, each of the same size: ``dL/dx = dL/dy · W^T`` (to pass the gradient
on) and ``dL/dW = x^T · dL/dy`` (to update ``W``), so 4 FLOPs per parameter per token. Training
therefore costs ``2 + 4 = 6`` FLOPs per parameter per token, and a run of ``D`` tokens on ``N``
parameters costs

.. math::  C \\approx 6 N D.

**Which parameters.** Only those that *multiply* count: the embedding is a table lookup, no
arithmetic (the LM head, tied or not, is a real matmul and counts). ``llmu.moe.params`` holds the
course's parameter counter; :func:`forward_flops_per_token` takes its matmul count,
``flops_per_token(shape)["matmul"] = 2 · N_matmul``. Kaplan et al. (2020) use ``N`` = the
non-embedding parameters; Hoffmann et al. (2022, Chinchilla) count all parameters. For a large
model the difference is a few percent; for a small one (SmolLM2-135M: 28 M of its 135 M are the
embedding) it is not.

**Attention.** The score ``q·k`` and the weighted sum ``p·v`` involve no parameter, yet cost
``2·d_attn`` FLOPs each per (query, key) pair and layer, with ``d_attn = n_heads · head_dim``. Under
the causal mask, token ``t`` (1-based) of a sequence of ``T`` attends to ``t`` positions, so the
mean over the sequence is ``(T + 1)/2`` positions and the forward pass costs, per token,

.. math::  4 · n_\\text{layers} · d_\\text{attn} · \\frac{T + 1}{2}
           = 2 · n_\\text{layers} · d_\\text{attn} · (T + 1),

which is Kaplan et al.'s ``2·n_layer·n_ctx·d_attn`` (their Table 1) up to the ``+1``. Training is
3x the forward here too: ``6·n_layers·d_attn·(T + 1)`` per token. This module uses that causal
count (the one of ``llmu.moe.params.flops_per_token`` averaged over a sequence). Chinchilla's own
accounting (Hoffmann et al., appendix F) counts the full ``T x T`` score matrix, twice as much,
and adds the softmax; both are conventions, and every MFU figure depends on which one it used.

Element-wise work (norms, activations, softmax, the optimizer's update of each parameter) is a
few FLOPs per element or per parameter, not per parameter *per token*: it is left out, as in the
papers.
"""

from __future__ import annotations

from llmu.checks import require_positive
from llmu.moe.params import DecoderShape, flops_per_token, from_llama_config

__all__ = ["LLAMA3_8B", "LLAMA3_70B", "as_shape", "training_flops", "matmul_parameters", "forward_flops_per_token",
           "train_flops_per_token", "train_step_flops", "attention_share", "kaplan_attention_flops"]


def as_shape(model_or_shape) -> DecoderShape:
    """A :class:`~llmu.moe.params.DecoderShape` from itself, an ``llmu.models.LlamaConfig`` or a
    model that has a ``.config`` (an ``llmu.models.LlamaModel``)."""
    if isinstance(model_or_shape, DecoderShape):
        return model_or_shape
    config = getattr(model_or_shape, "config", model_or_shape)
    if all(hasattr(config, key) for key in ("hidden_size", "num_hidden_layers", "vocab_size", "head_dim")):
        return from_llama_config(config)
    raise TypeError(f"expected a DecoderShape, an llmu LlamaConfig or a model with .config, "
                    f"got {type(model_or_shape).__name__}")


def training_flops(n_params: float, tokens: float) -> float:
    """``6·N·D``: the training FLOPs of ``tokens`` tokens on ``n_params`` parameters (no attention)."""
    require_positive("n_params", n_params)
    require_positive("tokens", tokens)
    return 6.0 * n_params * tokens


def matmul_parameters(shape) -> int:
    """The parameters that multiply a token's activations in the forward pass (the active ones,
    without the embedding table; the LM head counts even when tied): ``flops_per_token / 2``."""
    return flops_per_token(as_shape(shape))["matmul"] // 2


def _require_seq_len(seq_len) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    return seq_len


def forward_flops_per_token(shape, seq_len: int) -> dict:
    """Forward FLOPs per token, averaged over a causal sequence of ``seq_len`` tokens.

    ``{"matmul": 2·N_matmul, "attention": 2·n_layers·d_attn·(seq_len + 1), "total": their sum}``
    (module docstring): ``llmu.moe.params.flops_per_token`` at ``context = seq_len + 1``, halved
    for the attention (the mean context of a causal sequence is ``(seq_len + 1)/2``).
    """
    shape = as_shape(shape)
    seq_len = _require_seq_len(seq_len)
    per_token = flops_per_token(shape, context=seq_len + 1)
    attention = per_token["attention"] // 2     # 4·L·d_attn·(T+1) is even: the halving is exact
    return {"matmul": per_token["matmul"], "attention": attention, "total": per_token["matmul"] + attention}


def train_flops_per_token(shape, seq_len: int) -> dict:
    """Training FLOPs per token (forward + backward = 3x the forward): ``6·N_matmul`` for the
    matmuls, ``6·n_layers·d_attn·(seq_len + 1)`` for attention, and their ``"total"``."""
    forward = forward_flops_per_token(shape, seq_len)
    return {key: 3 * value for key, value in forward.items()}


def train_step_flops(shape, batch: int, seq_len: int) -> int:
    """Model FLOPs of one training step on ``batch`` sequences of ``seq_len`` tokens (what an MFU
    figure divides by the step's time)."""
    require_positive("batch", batch, integer=True)
    return batch * seq_len * train_flops_per_token(shape, seq_len)["total"]


def attention_share(shape, seq_len: int) -> float:
    """The fraction of training FLOPs that attention's scores and weighted sums take at ``seq_len``."""
    per_token = train_flops_per_token(shape, seq_len)
    return per_token["attention"] / per_token["total"]


def kaplan_attention_flops(n_layers: int, seq_len: int, d_attn: int) -> int:
    """Kaplan et al.'s training attention FLOPs per token, ``6·n_layers·seq_len·d_attn`` (3x their
    forward ``2·n_layer·n_ctx·d_attn``); :func:`train_flops_per_token` gives ``seq_len + 1``."""
    for name, value in (("n_layers", n_layers), ("seq_len", seq_len), ("d_attn", d_attn)):
        require_positive(name, value, integer=True)
    return 6 * n_layers * seq_len * d_attn


#: Meta-Llama-3-8B's config.json (dense, GQA 32/8, untied head): 8.03 B parameters.
LLAMA3_8B = DecoderShape(
    name="Llama-3-8B", vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, intermediate_size=14336, tie_word_embeddings=False,
)

#: Meta-Llama-3-70B's config.json (dense, GQA 64/8, untied head): 70.6 B parameters.
LLAMA3_70B = DecoderShape(
    name="Llama-3-70B", vocab_size=128256, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8, intermediate_size=28672, tie_word_embeddings=False,
)
