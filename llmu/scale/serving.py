"""Serving economics: from tokens per second per GPU to dollars per million tokens.

A GPU rented at ``p`` dollars per hour that produces ``r`` tokens per second costs

.. math::  \\text{\\$ per million tokens} = \\frac{p}{3600 \\, r} \\times 10^6 .

Everything else is about ``r``, and it differs by phase (module 05):

- **Prefill** (input tokens) is compute-bound: a prompt of many tokens is one big matmul per
  weight, so ``r_prefill ≈ utilization · peak FLOP/s / (2·N_matmul + attention)`` FLOPs per token.
- **Decode** (output tokens) is memory-bound at small batches: each step reads every weight once,
  plus each sequence's KV cache, to emit one token per sequence. A step over a batch of ``B``
  sequences of ``c`` tokens of context therefore takes at least

  .. math::  t_\\text{step} = \\max\\left(\\frac{W + B \\cdot c \\cdot \\text{kv}}{\\text{bandwidth}},\\;
             \\frac{B \\cdot f}{\\text{peak}}\\right)

  with ``W`` the weight bytes, ``kv`` the KV-cache bytes of one token
  (``2 · n_layers · n_kv_heads · head_dim · bytes``), ``f`` the forward FLOPs of one token; and
  ``r_decode ≤ B / t_step``. Batching spreads the weight read over ``B`` tokens, which is why
  serving engines batch (module 16) until the KV cache fills memory or the compute roof is hit.

That is why providers price output tokens several times higher than input tokens: a GPU second
yields far more prefill tokens than decode tokens. The ceilings here are roofline bounds (no real
engine reaches them: kernels reach 70-90 % of bandwidth, and scheduling, sampling and the host
add overhead); a measured tokens/s, like the engine's of module 16, is the figure to price.
Dollar figures per GPU-hour are inputs the caller chooses, never facts of this module.
"""

from __future__ import annotations

from llmu.checks import require_positive
from llmu.moe.params import count_parameters, flops_per_token
from llmu.scale.flops import as_shape, forward_flops_per_token

__all__ = ["cost_per_million_tokens", "kv_bytes_per_token", "weight_bytes", "decode_step_seconds",
           "decode_tokens_per_s", "prefill_tokens_per_s"]


def _roof(roof) -> tuple[float, float]:
    """``(peak_flops, bandwidth)`` of an ``llmu.roofline.Roof`` or a ``MachineRoof``."""
    try:
        peak, bandwidth = float(roof.peak_flops), float(roof.bandwidth)
    except AttributeError:
        raise TypeError(f"roof must have peak_flops and bandwidth (an llmu.roofline Roof or MachineRoof), "
                        f"got {type(roof).__name__}") from None
    return peak, bandwidth


def cost_per_million_tokens(tokens_per_s: float, dollars_per_hour: float) -> float:
    """Dollars per million tokens of a device producing ``tokens_per_s`` at ``dollars_per_hour``."""
    require_positive("tokens_per_s", tokens_per_s)
    require_positive("dollars_per_hour", dollars_per_hour)
    return dollars_per_hour / (3600.0 * tokens_per_s) * 1e6


def kv_bytes_per_token(shape, bytes_per_value: float = 2) -> float:
    """KV-cache bytes one token adds: keys and values of every layer, ``2·L·n_kv·head_dim·bytes``."""
    shape = as_shape(shape)
    require_positive("bytes_per_value", bytes_per_value)
    return 2.0 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * bytes_per_value


def weight_bytes(shape, bytes_per_param: float = 2) -> float:
    """Bytes of all the weights (every expert of an MoE: all are stored and, at batch size, all read)."""
    require_positive("bytes_per_param", bytes_per_param)
    return float(count_parameters(as_shape(shape)).total) * bytes_per_param


def decode_step_seconds(shape, batch: int, context: int, roof, bytes_per_param: float = 2,
                        bytes_per_value: float | None = None) -> float:
    """The roofline's lower bound on one decode step of ``batch`` sequences of ``context`` tokens
    of context each (module docstring). ``roof``: the device (``peak_flops``, ``bandwidth``);
    ``bytes_per_value``: of the KV cache (default: the weights')."""
    shape = as_shape(shape)
    require_positive("batch", batch, integer=True)
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an int >= 0, got {context!r}")
    peak, bandwidth = _roof(roof)
    kv = kv_bytes_per_token(shape, bytes_per_param if bytes_per_value is None else bytes_per_value)
    memory = (weight_bytes(shape, bytes_per_param) + batch * context * kv) / bandwidth
    compute = batch * flops_per_token(shape, context=context + 1)["total"] / peak
    return max(memory, compute)


def decode_tokens_per_s(shape, batch: int, context: int, roof, bytes_per_param: float = 2,
                        bytes_per_value: float | None = None) -> float:
    """The decode ceiling in tokens/s: ``batch`` tokens per :func:`decode_step_seconds`."""
    return batch / decode_step_seconds(shape, batch, context, roof, bytes_per_param, bytes_per_value)


def prefill_tokens_per_s(shape, prompt_len: int, roof, utilization: float = 1.0) -> float:
    """Prefill tokens/s of prompts of ``prompt_len`` tokens at ``utilization`` of the compute peak
    (compute-bound: forward FLOPs of a token, attention averaged over the causal prompt)."""
    require_positive("utilization", utilization)
    if utilization > 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    peak, _ = _roof(roof)
    return utilization * peak / forward_flops_per_token(shape, prompt_len)["total"]
