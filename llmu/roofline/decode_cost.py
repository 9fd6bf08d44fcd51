"""One decode step of a Llama-family decoder, counted op by op, and put on the roofline.

:func:`step_cost` lists the operations of one decode step for ``batch`` sequences that each hold
``context`` tokens in the KV cache (the step adds one token to each): their FLOPs and the bytes
they move. :func:`predict_time` turns the list into a time on a device of ``peak_flops`` and
``bandwidth``: each op takes at least ``max(flops / peak_flops, bytes / bandwidth)``, and the step
the sum of those. :func:`measure_decode_steps` times real steps of an ``llmu.models.LlamaModel``
to compare with.

Conventions (those of notebook 05's exercise 6):

* **FLOPs.** A multiply-add is 2 FLOPs. A linear layer of ``n_in`` inputs and ``n_out`` outputs
  does ``2 B n_in n_out`` for ``B`` rows. Attention for one new token per sequence, over the
  ``n = context + 1`` positions it sees (the cache and its own): the scores ``q k`` and the
  weighted sum of the values, ``2 n D`` each per query head, ``4 B H n D`` in all (``H`` query
  heads of ``D`` channels). An RMSNorm of ``B`` rows of ``d`` is ``4 B d`` (square, add, scale,
  gain: the registry's count, ``llmu.layers.bench``).
* **Bytes.** Each op reads its weights once for the whole batch, reads its input rows and writes
  its output rows, once each, ``elem_bytes`` per element (a GEMM's minimal traffic, as
  :func:`llmu.roofline.model.gemm_bytes`). The key and value projections write their outputs
  into the KV cache (``kv_elem_bytes`` per element). Attention reads the query rows, reads the
  keys and values of all ``n`` positions of every sequence from the cache (``2 B n Hkv D``
  elements, ``kv_elem_bytes`` each) and writes its output rows; the scores stay on chip (a fused
  kernel). An RMSNorm reads its gain (``d``), its input and writes its output.
* **Neglected**: the embedding lookup (``B`` rows copied), RoPE, the softmax, SwiGLU's gate
  product and the residual adds: a few FLOPs per element of vectors that a fused implementation
  never writes to memory on their own.
* **Layers.** The ten ops of a layer appear once each, with the totals of all ``L`` layers (the
  roofline time of an op repeated ``L`` times is ``L`` times its own, so nothing is lost). Then
  the final norm and the LM head. A tied head reads the embedding matrix: the same ``V d`` bytes
  as an untied one, read once. The weights a step reads are therefore every parameter, less the
  embedding table of an untied model (of which a step reads only ``B`` rows).

Biases (``attention_bias``, ``attention_out_bias``; Qwen2's q, k and v have one) are read with
their weights and add ``B n_out`` FLOPs; the course's SmolLM2 has none.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = ["OP_NAMES", "LAYER_OPS", "StepOp", "step_cost", "predict_time", "step_totals", "measure_decode_steps"]

#: The ops of one layer, in the order a step runs them (each listed once, for all the layers).
LAYER_OPS = ("attn_norm", "q_proj", "k_proj", "v_proj", "attention", "o_proj",
             "mlp_norm", "gate_proj", "up_proj", "down_proj")
#: Every op :func:`step_cost` lists, in order.
OP_NAMES = LAYER_OPS + ("final_norm", "lm_head")

_CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size")


class StepOp(NamedTuple):
    """One operation of a decode step: its name, FLOPs and bytes moved (over all the layers)."""

    name: str
    flops: int
    bytes: int | float


def _count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _size(name: str, value) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of bytes per element, got {value!r}")
    return value


def _config(cfg) -> dict:
    missing = [f for f in _CONFIG_FIELDS if not hasattr(cfg, f)]
    if missing:
        raise TypeError(f"cfg must be a Llama config (llmu.models.LlamaConfig); {type(cfg).__name__} has no {missing}")
    shape = {f: getattr(cfg, f) for f in _CONFIG_FIELDS}
    for f, v in shape.items():
        _count(f"cfg.{f}", v, 1)
    if shape["num_attention_heads"] % shape["num_key_value_heads"]:
        raise ValueError(f"cfg: num_attention_heads ({shape['num_attention_heads']}) must be a multiple of "
                         f"num_key_value_heads ({shape['num_key_value_heads']})")
    return shape


def step_cost(cfg, batch: int, context: int, elem_bytes: int | float = 2,
              kv_elem_bytes: int | float | None = None) -> list[StepOp]:
    """The ops of one decode step of ``batch`` sequences, each with ``context`` tokens cached.

    ``cfg``: an ``llmu.models.LlamaConfig`` (or anything with its shape fields); ``elem_bytes``
    per weight and activation element (2 for bf16, 4 for fp32, 0.5 for int4); ``kv_elem_bytes``
    per KV-cache element (default: ``elem_bytes``). Returns :data:`OP_NAMES` as :class:`StepOp`
    rows, per-layer ops totalled over the layers (the module's docstring has the conventions).
    FLOPs are ints; bytes are ints when the element sizes are.

    ``ValueError`` when ``batch`` is not an int >= 1, ``context`` not an int >= 0 (a bool is
    neither), or an element size is not a positive number; ``TypeError`` when ``cfg`` lacks a field.
    """
    s = _config(cfg)
    b = _count("batch", batch, 1)
    c = _count("context", context, 0)
    e = _size("elem_bytes", elem_bytes)
    kv = e if kv_elem_bytes is None else _size("kv_elem_bytes", kv_elem_bytes)
    d, f, L = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    h, hkv, hd, v = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"], s["vocab_size"]
    q, kvd, n = h * hd, hkv * hd, c + 1
    qkv_bias = bool(getattr(cfg, "attention_bias", False))
    o_bias = bool(getattr(cfg, "attention_out_bias", False))

    def linear(name, n_in, n_out, out_bytes=e, bias=False, layers=L):
        flops = 2 * b * n_in * n_out + (b * n_out if bias else 0)
        weights = n_in * n_out + (n_out if bias else 0)
        return StepOp(name, layers * flops, layers * (e * (weights + b * n_in) + out_bytes * b * n_out))

    def norm(name, layers=L):
        return StepOp(name, layers * 4 * b * d, layers * e * (d + 2 * b * d))

    attention = StepOp("attention", L * 4 * b * h * n * hd, L * (e * 2 * b * q + kv * 2 * b * n * kvd))
    return [
        norm("attn_norm"),
        linear("q_proj", d, q, bias=qkv_bias),
        linear("k_proj", d, kvd, out_bytes=kv, bias=qkv_bias),
        linear("v_proj", d, kvd, out_bytes=kv, bias=qkv_bias),
        attention,
        linear("o_proj", q, d, bias=o_bias),
        norm("mlp_norm"),
        linear("gate_proj", d, f),
        linear("up_proj", d, f),
        linear("down_proj", f, d),
        norm("final_norm", layers=1),
        linear("lm_head", d, v, layers=1),
    ]


def _rows(costs) -> list[tuple[str, float, float]]:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Iterable):
        raise TypeError(f"costs must be a list of (name, flops, bytes), got {type(costs).__name__}")
    rows = []
    for i, op in enumerate(costs):
        try:
            name, flops, nbytes = op
        except (TypeError, ValueError):
            raise ValueError(f"costs[{i}] must be (name, flops, bytes), got {op!r}") from None
        for what, x in (("flops", flops), ("bytes", nbytes)):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x >= 0):
                raise ValueError(f"costs[{i}] ({name}): {what} must be a finite number >= 0, got {x!r}")
        rows.append((name, flops, nbytes))
    return rows


def predict_time(costs: Sequence, peak_flops: float, bandwidth: float) -> float:
    """Seconds for the ops ``costs`` (``(name, flops, bytes)`` rows, as :func:`step_cost` gives) on
    a device of ``peak_flops`` FLOP/s and ``bandwidth`` bytes/s: each op at its own roof,
    ``max(flops / peak_flops, bytes / bandwidth)``, one after the other.

    Not ``max(total flops / peak, total bytes / bandwidth)``: that lets a memory-bound op overlap a
    compute-bound one, which a step that runs its ops in turn does not do. ``ValueError`` when
    ``peak_flops`` or ``bandwidth`` is not positive, or a row is not ``(name, flops >= 0, bytes >= 0)``.
    """
    for what, x in (("peak_flops", peak_flops), ("bandwidth", bandwidth)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x > 0):
            raise ValueError(f"{what} must be a positive number, got {x!r}")
    return sum(max(flops / peak_flops, nbytes / bandwidth) for _, flops, nbytes in _rows(costs))


def step_totals(costs: Sequence) -> tuple[float, float]:
    """``(flops, bytes)`` summed over the ops ``costs``."""
    rows = _rows(costs)
    return sum(r[1] for r in rows), sum(r[2] for r in rows)


def measure_decode_steps(model, batches: Sequence[int] = (1, 8, 32), context: int = 64, steps: int = 4, *,
                         threads: int | None = None, seed: int = 0) -> list[dict]:
    """Time decode steps of ``model`` (an ``llmu.models.LlamaModel``) at each batch size.

    For each batch ``B``: a :class:`llmu.models.KVCache` of ``B`` sequences whose first ``context``
    positions hold zeros (what the cache holds does not change what a step costs, and a prefill of
    ``B x context`` tokens would cost far more than the steps), then one untimed step and
    ``steps`` timed ones, each a forward pass of one random token per sequence through the model's
    modules (``model(ids, cache=cache, last_only=True)``, the path a batch takes). The cache is
    cropped back to ``context`` before every step, so each one is :func:`step_cost`'s step of
    ``B`` sequences with ``context`` cached tokens.

    Returns one dict per batch: ``batch``, ``context``, ``steps``, ``ms`` (the median step),
    ``ms_min``, ``ms_max`` and ``ms_per_token`` (``ms / batch``).
    """
    import torch

    from llmu.bench.machine import Threads, sync
    from llmu.models.cache import KVCache

    batches = [_count(f"batches[{i}]", bb, 1) for i, bb in enumerate(batches)]
    if not batches:
        raise ValueError("batches is empty")
    context = _count("context", context, 0)
    steps = _count("steps", steps, 1)
    limit = model.config.max_position_embeddings
    if context + 1 > limit:
        raise ValueError(f"context {context} + the new token exceeds the model's context of {limit}")
    g = torch.Generator().manual_seed(seed)
    rows = []
    with Threads(threads), torch.inference_mode():
        for b in batches:
            cache = KVCache.for_model(model, b, max_len=context + 1)
            for k, v in zip(cache.k, cache.v):
                k.zero_()
                v.zero_()
            times = []
            for i in range(steps + 1):
                ids = torch.randint(0, model.config.vocab_size, (b, 1), generator=g).to(model.device)
                cache.crop(0)
                cache.advance(context)
                start = time.perf_counter()
                model(ids, cache=cache, last_only=True)
                sync(model.device)
                if i:  # the first step allocates and chooses kernels
                    times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1e3
            rows.append(dict(batch=b, context=context, steps=steps, ms=ms, ms_min=min(times) * 1e3,
                             ms_max=max(times) * 1e3, ms_per_token=ms / b))
            del cache
    return rows
