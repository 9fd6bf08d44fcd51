"""The memory of one training step, per GPU: a calculator for choosing a parallel layout.

Training a model of ``Ψ`` parameters with Adam keeps four things in GPU memory:

- **weights**: ``Ψ`` numbers, 2 bytes each in bf16/fp16;
- **gradients**: one per weight, 2 bytes in mixed precision;
- **optimizer states**: Adam's two moments and, in mixed precision, an fp32 master copy of the
  weights: ``K = 12`` bytes per parameter (ZeRO's "2 + 2 + K"). ``llmu.parallel.zero`` holds these
  formulas (:func:`llmu.parallel.zero.zero_memory_formula`); this module reuses them;
- **activations**: what the forward pass saves for the backward. They grow with the batch and the
  sequence, not with ``Ψ``.

Activations per transformer layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4): with sequence length ``s``, micro-batch ``b``, hidden size
``h`` and ``a`` attention heads, a layer stores

    s·b·h·(34 + 5·a·s/h)  bytes

under these assumptions: activations in 16 bits (2 bytes), dropout masks in 1 byte, a GPT-style
layer (multi-head attention, a 4h-wide GeLU MLP, two LayerNorms, dropout after attention and
MLP), and the ``a·s²`` attention scores and softmax stored (no FlashAttention). The ``34`` collects
the linear-in-``s`` terms (QKV input, Q and K, V, the attention output projection's input, the MLP's
inputs, norms, masks); ``5·a·s/h`` the quadratic ones (scores, softmax, its dropout mask, per
``s·b·h``). For a Llama layer (SwiGLU, no dropout, GQA) the numbers differ a little; the shape of
the formula, and the conclusions, stay. With tensor parallelism of degree ``t`` (Korthikanti's
Table 2):

- tensor parallel alone: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` (norms and dropouts stay replicated);
- with sequence parallelism: ``s·b·h·(34/t + 5·a·s/(h·t))`` (those parts split along the sequence);
- **selective recomputation** (recompute the attention core in the backward, as FlashAttention
  does anyway): the ``5·a·s/h`` term goes;
- **full recomputation** (keep only each layer's input, run the layer's forward again in the
  backward): ``2·s·b·h`` per layer, plus one layer's full activations while it is recomputed.

Per rank, the parallel degrees divide these: tensor ``t`` splits each weight matrix (and, with
sequence parallelism, the activations), pipeline ``p`` gives each rank ``L/p`` layers, context
``c`` splits the sequence (``s/c`` tokens per rank), data ``d`` replicates everything unless ZeRO
shards it. Under 1F1B the first pipeline stage holds ``p`` micro-batches in flight (``min(p, m)``),
each through its ``L/p`` layers: ``L`` layers' worth of one micro-batch's activations, whatever
``p`` is. The logits of the last stage (``4·s·b·V/t`` bytes in fp32) are counted when ``p = 1``.

Assumptions of the per-rank weights: every weight matrix, the embedding and the LM head included,
splits evenly over ``t·p`` ranks (vocabulary-parallel embedding and head, equal stages); a real
layout puts the embedding and the head on the first and last stages, which are then heavier.
Temporary buffers, the allocator's fragmentation and the communication buffers are not counted:
plan for ~10-20 % more.

Functions: :func:`activation_bytes_per_layer`, :func:`training_memory` (the whole breakdown,
per rank), :func:`memory_table` (several layouts side by side). Presets: ``LLAMA2_7B``,
``LLAMA3_70B``, ``LLAMA31_405B`` (``llmu.moe.params.DecoderShape``, from their published
configs) and GPU memory sizes in :data:`GPU_MEMORY_GB`.
"""

from __future__ import annotations

from llmu.moe.params import DecoderShape, count_parameters
from llmu.parallel.zero import PRECISIONS, zero_memory_formula

__all__ = ["RECOMPUTE", "LLAMA2_7B", "LLAMA3_70B", "LLAMA31_405B", "MODELS", "GPU_MEMORY_GB",
           "activation_bytes_per_layer", "training_memory", "memory_table"]

#: Activation recomputation policies: keep everything, recompute attention's core, keep only layer inputs.
RECOMPUTE = ("none", "selective", "full")

#: Llama-2-7B's config.json (multi-head attention, 32 KV heads).
LLAMA2_7B = DecoderShape(name="Llama-2-7B", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008)

#: Llama-3-70B's config.json (GQA with 8 KV heads).
LLAMA3_70B = DecoderShape(name="Llama-3-70B", vocab_size=128256, hidden_size=8192, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672)

#: Llama-3.1-405B's config.json (GQA with 8 KV heads, 126 layers).
LLAMA31_405B = DecoderShape(name="Llama-3.1-405B", vocab_size=128256, hidden_size=16384, num_hidden_layers=126,
                            num_attention_heads=128, num_key_value_heads=8, intermediate_size=53248)

MODELS = {s.name: s for s in (LLAMA2_7B, LLAMA3_70B, LLAMA31_405B)}

#: GPU memory in GB (1e9 bytes), from the vendors' datasheets.
GPU_MEMORY_GB = {"A100 80GB": 80, "H100 SXM": 80, "H200": 141, "B200": 180}


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, *,
                               tensor_parallel: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none") -> float:
    """Bytes one transformer layer keeps for its backward, per rank (Korthikanti et al. 2022).

    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with tensor parallelism ``t`` (``34/t`` instead of
    ``10 + 24/t`` with ``sequence_parallel``); ``recompute="selective"`` drops the attention term,
    ``"full"`` keeps only the layer's input, ``2·s·b·h`` (``/t`` with sequence parallelism). See
    the module docstring for the assumptions (16-bit activations, GPT layer, no FlashAttention).
    """
    s, b, h, a = (_positive_int(n, v) for n, v in (("seq_len", seq_len), ("micro_batch", micro_batch),
                                                     ("hidden", hidden), ("heads", heads)))
    t = _positive_int("tensor_parallel", tensor_parallel)
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    linear = 34 / t if sequence_parallel else 10 + 24 / t       # per s·b·h
    attention = 5 * a * s / (h * t) if recompute == "none" else 0.0
    return sbh * (linear + attention)


def training_memory(shape: DecoderShape, *, seq_len: int, micro_batch: int = 1, precision: str = "mixed",
                    data_parallel: int = 1, zero_stage: int = 0, tensor_parallel: int = 1,
                    pipeline_parallel: int = 1, context_parallel: int = 1, sequence_parallel: bool | None = None,
                    recompute: str = "none", micro_batches: int | None = None) -> dict:
    """Bytes per GPU of one training step of ``shape`` under a parallel layout.

    ``precision``: ``"mixed"`` (bf16 weights and gradients, ``K = 12`` bytes of fp32 optimizer
    state) or ``"float32"`` (4 + 4 + 8); ``zero_stage`` 0-3 shards over the ``data_parallel``
    ranks; ``tensor_parallel`` ``t``, ``pipeline_parallel`` ``p``, ``context_parallel`` ``c``
    (the sequence split, ``seq_len`` must divide); ``sequence_parallel`` defaults to ``t > 1``
    (Megatron's practice); ``micro_batches`` ``m`` (default ``p``): the first stage under 1F1B
    holds ``min(p, m)`` of them.

    Returns ``params``, ``grads``, ``optimizer`` (from :func:`llmu.parallel.zero.zero_memory_formula`
    on this rank's ``Ψ / (t·p)`` parameters), ``activations``, ``total``, and ``num_params`` (``Ψ``)
    and ``params_per_rank``. Activations are counted as 16-bit whatever ``precision`` is.
    """
    if not isinstance(shape, DecoderShape):
        raise TypeError(f"shape must be an llmu.moe.params.DecoderShape, got {type(shape).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    dp, t, p, c = (_positive_int(n, v) for n, v in (
        ("data_parallel", data_parallel), ("tensor_parallel", tensor_parallel),
        ("pipeline_parallel", pipeline_parallel), ("context_parallel", context_parallel)))
    s = _positive_int("seq_len", seq_len)
    if s % c:
        raise ValueError(f"seq_len={s} must be divisible by context_parallel={c}")
    if p > shape.num_hidden_layers:
        raise ValueError(f"pipeline_parallel={p} is more than the model's {shape.num_hidden_layers} layers")
    m = p if micro_batches is None else _positive_int("micro_batches", micro_batches)
    sp = t > 1 if sequence_parallel is None else sequence_parallel

    # Step 1: weights, gradients, optimizer states of this rank's Ψ/(t·p) parameters, ZeRO over d
    num_params = count_parameters(shape).total
    per_rank = -(-num_params // (t * p))
    states = zero_memory_formula(per_rank, dp, zero_stage, precision)

    # Step 2: activations of the first pipeline stage: L/p layers × min(p, m) micro-batches in flight
    per_layer = activation_bytes_per_layer(s // c, micro_batch, shape.hidden_size, shape.num_attention_heads,
                                           tensor_parallel=t, sequence_parallel=sp, recompute=recompute)
    layers_here = -(-shape.num_hidden_layers // p)
    activations = per_layer * layers_here * min(p, m)
    if recompute == "full":     # the layer being recomputed holds its full activations for a moment
        activations += activation_bytes_per_layer(s // c, micro_batch, shape.hidden_size, shape.num_attention_heads,
                                                  tensor_parallel=t, sequence_parallel=sp, recompute="selective")
    if p == 1:                  # the logits, in fp32 for the cross-entropy (Korthikanti: 4·s·b·V/t)
        activations += 4 * (s // c) * micro_batch * shape.vocab_size / t
    total = states["total"] + activations
    return {"params": states["params"], "grads": states["grads"], "optimizer": states["optimizer"],
            "activations": activations, "total": total, "num_params": num_params, "params_per_rank": per_rank}


def memory_table(shape: DecoderShape, layouts: list[dict], **common) -> list[dict]:
    """One row per layout (a dict of :func:`training_memory` keywords, merged over ``common``):
    the layout's keywords, then the breakdown in GB (1e9 bytes)."""
    if not isinstance(layouts, (list, tuple)) or not all(isinstance(x, dict) for x in layouts):
        raise TypeError("layouts must be a list of dicts of training_memory keywords")
    rows = []
    for layout in layouts:
        got = training_memory(shape, **{**common, **layout})
        rows.append({**layout, **{k: got[k] / 1e9 for k in ("params", "grads", "optimizer", "activations", "total")}})
    return rows
