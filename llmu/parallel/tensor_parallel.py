"""Tensor parallelism (Megatron-LM): one layer's weight matrices split over ``W`` processes.

Data parallelism copies the whole model to every rank; when one layer no longer fits, or is too
slow for one device, *tensor parallelism* (Shoeybi et al. 2019, "Megatron-LM") splits each weight
matrix and lets every rank compute its part of every matmul, on the **same** tokens.

A linear layer ``y = x W^T`` (``W``: ``(out, in)``) can be split two ways:

- **column-parallel** (:class:`ColumnParallelLinear`): rank ``r`` holds rows ``r*out/W ..`` of
  ``W``, i.e. a slice of the *output* features. Every rank needs all of ``x`` and produces its
  slice of ``y``; no communication in the forward pass.
- **row-parallel** (:class:`RowParallelLinear`): rank ``r`` holds columns ``r*in/W ..`` of
  ``W``, a slice of the *input* features. Rank ``r`` reads its slice of ``x`` and produces a
  *partial sum* ``x_r W_r^T`` of the full ``y``: an all-reduce (SUM) completes it.

Put one after the other, the slice of features a column-parallel layer produces is exactly what
the row-parallel layer needs, so anything element-wise in between (SwiGLU's ``silu(g) * u``, or
attention, which is independent per head) runs locally. The Megatron MLP is then::

    x ──f──> gate (column) ─┐
             up   (column) ─┴─ silu(g) * u ──> down (row) ──g──> y

with two *conjugate* operators (:func:`copy_to_tensor_parallel` = ``f``,
:func:`reduce_from_tensor_parallel` = ``g``):

- ``f``: identity forward (every rank already holds ``x``); **all-reduce backward**: each rank's
  ``dx`` is the gradient through its own slice of features only, the full ``dx`` is their sum;
- ``g``: **all-reduce forward** (sum the partial outputs); identity backward (the gradient of a
  sum with respect to each term is the gradient of the sum).

Attention is split the same way with the heads as the unit: ``q``, ``k``, ``v`` column-parallel
by heads (with grouped-query attention the KV heads are split too, so every rank keeps its query
heads together with the KV heads they share), attention on the local heads, ``o`` row-parallel.
A decoder layer (attention + MLP) therefore costs **two all-reduces of ``B*T*d_model`` numbers
forward and two backward**, and nothing else: the norms and residuals run replicated.
:func:`count_communication` records every collective this module issues, to check that count.

Weights are never initialised here: every layer is cut from a full one (``nn.Linear``, or llmu's
``models.llama.Linear``/``MLP``/``Attention``/``DecoderLayer``) built the same way on every rank,
so the tests compare the sharded layer with the unsharded one, forward and backward.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from llmu.layers.reference import apply_rope, silu_mul
from llmu.models.backends import get_attention_backend

__all__ = ["Collective", "count_communication", "record_collective", "shard_size", "copy_to_tensor_parallel",
           "reduce_from_tensor_parallel", "gather_from_tensor_parallel", "scatter_to_tensor_parallel",
           "ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP", "TensorParallelAttention",
           "TensorParallelDecoderLayer", "megatron_all_reduces", "DEMO_MODEL", "demo"]


# ----------------------------------------------------------------------------------------------
# Counting the communication
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective call: ``op`` (``"all_reduce"``, ``"all_gather"``, ``"send"``), the ``phase`` it ran in
    (``"forward"`` or ``"backward"``), the ``numel`` of this rank's tensor and its ``nbytes``."""

    op: str
    phase: str
    numel: int
    nbytes: int


_LOGS: list[list[Collective]] = []     # the lists of the count_communication blocks now open


@contextlib.contextmanager
def count_communication():
    """Record the collectives of this package issued inside the ``with`` block (this rank's view).

    Example::

        with count_communication() as log:
            y = tp_mlp(x); y.sum().backward()
        [(c.op, c.phase, c.nbytes) for c in log]
    """
    log: list[Collective] = []
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def record_collective(op: str, phase: str, t: torch.Tensor) -> None:
    """Add one collective on ``t`` to every open :func:`count_communication` log (other parallel
    modules call it too: ring attention records its sends)."""
    for log in _LOGS:
        log.append(Collective(op, phase, t.numel(), t.numel() * t.element_size()))


# ----------------------------------------------------------------------------------------------
# Shapes and the process group
# ----------------------------------------------------------------------------------------------


def shard_size(name: str, size: int, world_size: int) -> int:
    """``size / W``, refusing a ``size`` that ``W`` ranks cannot share evenly (``name`` says what)."""
    for arg, value in (("size", size), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    if size % world_size:
        raise ValueError(f"{name}={size} is not divisible by world_size={world_size}: every rank must "
                         f"hold the same share")
    return size // world_size


def _require_group(group) -> tuple[int, int]:
    """``(world_size, rank)`` in ``group``, or a clear error outside a process group."""
    if not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs a process group: run it inside llmu.distributed.launch "
                           "(or after torch.distributed.init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(t: torch.Tensor, phase: str, group) -> torch.Tensor:
    """The SUM of ``t`` over the ranks, in a new tensor (``t`` itself is left alone)."""
    out = t.contiguous().clone()
    record_collective("all_reduce", phase, out)
    dist.all_reduce(out, group=group)
    return out


def _all_gather_last(t: torch.Tensor, phase: str, group) -> torch.Tensor:
    """The ranks' ``t`` concatenated along the last dimension, in rank order."""
    world = dist.get_world_size(group)
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(world)]
    record_collective("all_gather", phase, t)
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=-1)


def _my_slice_last(t: torch.Tensor, group) -> torch.Tensor:
    """This rank's ``1/W`` of ``t``'s last dimension."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = shard_size("the last dimension", t.shape[-1], world)
    return t[..., rank * size:(rank + 1) * size].contiguous()


# ----------------------------------------------------------------------------------------------
# The conjugate operators
# ----------------------------------------------------------------------------------------------


class _CopyToTensorParallel(torch.autograd.Function):
    """``f``: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return _all_reduce(dx, "backward", ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, "forward", group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, "forward", group)

    @staticmethod
    def backward(ctx, dy):
        return _my_slice_last(dy, ctx.group), None


class _ScatterToTensorParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_slice_last(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_last(dy, "backward", ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's ``f``: ``x`` unchanged; in backward, the all-reduce (SUM) of its gradient.

    Put it where a replicated activation enters the column-parallel layers: each rank's gradient
    covers only its own output features, and the full gradient of ``x`` is their sum."""
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's ``g``: the all-reduce (SUM) of the ranks' partial outputs; identity backward."""
    return _ReduceFromTensorParallel.apply(x, group)


def gather_from_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """The ranks' feature slices concatenated (all-gather); backward keeps this rank's slice."""
    return _GatherFromTensorParallel.apply(x, group)


def scatter_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of ``x``'s features; backward all-gathers the slices' gradients."""
    return _ScatterToTensorParallel.apply(x, group)


# ----------------------------------------------------------------------------------------------
# The two linear layers
# ----------------------------------------------------------------------------------------------


def _check_linear(name: str, linear) -> None:
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise TypeError(f"{name} must be a linear layer with a 2-D weight (nn.Linear or "
                        f"llmu.models.llama.Linear), got {type(linear).__name__}")


def _parameter(t: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    """A copy of ``t`` as a parameter that trains when the full layer's weight does."""
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=like.requires_grad)


class ColumnParallelLinear(nn.Module):
    """This rank's rows of ``W`` (a slice of the output features): ``y_r = x W_r^T (+ b_r)``.

    Build it from a full layer with :meth:`from_linear` on every rank. ``forward(x)`` takes the
    full (replicated) ``x`` ``(..., in)`` and returns ``(..., out/W)``, or, with
    ``gather_output``, the full ``(..., out)`` (an all-gather). ``copy_input`` applies ``f``
    (all-reduce of ``dx`` in backward); a block whose several column-parallel layers read the same
    ``x`` turns it off and applies ``f`` once itself, so their input gradients are summed by a
    single all-reduce.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gather_output: bool = False,
                 copy_input: bool = True, group=None):
        super().__init__()
        if not isinstance(weight, nn.Parameter) or weight.ndim != 2:
            raise TypeError("weight must be a 2-D nn.Parameter (this rank's rows of W); "
                            "use ColumnParallelLinear.from_linear to cut it from a full layer")
        self.world_size, self.rank = _require_group(group)
        self.group, self.gather_output, self.copy_input = group, gather_output, copy_input
        self.weight, self.bias = weight, bias
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0] * self.world_size      # of the full layer

    @classmethod
    def from_linear(cls, linear, *, gather_output: bool = False, copy_input: bool = True,
                    group=None) -> "ColumnParallelLinear":
        """This rank's slice of ``linear``'s output features (rows of its weight, and its bias)."""
        _check_linear("linear", linear)
        world, rank = _require_group(group)
        size = shard_size("out_features", linear.weight.shape[0], world)
        rows = slice(rank * size, (rank + 1) * size)
        bias = getattr(linear, "bias", None)
        return cls(_parameter(linear.weight[rows], linear.weight),
                   None if bias is None else _parameter(bias[rows], bias),
                   gather_output=gather_output, copy_input=copy_input, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tensor_parallel(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(rows {self.rank * self.weight.shape[0]}..{(self.rank + 1) * self.weight.shape[0] - 1} on rank "
                f"{self.rank} of {self.world_size}), bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """This rank's columns of ``W`` (a slice of the input features): ``y = sum_r x_r W_r^T (+ b)``.

    ``forward(x)`` takes this rank's slice ``(..., in/W)`` of the input (what a column-parallel
    layer produced) and returns the full ``(..., out)`` on every rank: the partial products are
    summed by ``g`` (an all-reduce), then the bias, held whole, is added once. With
    ``input_is_parallel=False`` it takes the full ``x`` and keeps its own slice first.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, input_is_parallel: bool = True,
                 group=None):
        super().__init__()
        if not isinstance(weight, nn.Parameter) or weight.ndim != 2:
            raise TypeError("weight must be a 2-D nn.Parameter (this rank's columns of W); "
                            "use RowParallelLinear.from_linear to cut it from a full layer")
        self.world_size, self.rank = _require_group(group)
        self.group, self.input_is_parallel = group, input_is_parallel
        self.weight, self.bias = weight, bias
        self.in_features = weight.shape[1] * self.world_size       # of the full layer
        self.out_features = weight.shape[0]

    @classmethod
    def from_linear(cls, linear, *, input_is_parallel: bool = True, group=None) -> "RowParallelLinear":
        """This rank's slice of ``linear``'s input features (columns of its weight); the bias whole."""
        _check_linear("linear", linear)
        world, rank = _require_group(group)
        size = shard_size("in_features", linear.weight.shape[1], world)
        bias = getattr(linear, "bias", None)
        return cls(_parameter(linear.weight[:, rank * size:(rank + 1) * size], linear.weight),
                   None if bias is None else _parameter(bias, bias), input_is_parallel=input_is_parallel,
                   group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.group)
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"x must end in this rank's in_features/W={self.weight.shape[1]} features "
                             f"(in_features={self.in_features}, W={self.world_size}), got {tuple(x.shape)}")
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        cols = self.weight.shape[1]
        return (f"in_features={self.in_features} (columns {self.rank * cols}..{(self.rank + 1) * cols - 1} on rank "
                f"{self.rank} of {self.world_size}), out_features={self.out_features}, bias={self.bias is not None}")


# ----------------------------------------------------------------------------------------------
# The Megatron blocks
# ----------------------------------------------------------------------------------------------


class TensorParallelMLP(nn.Module):
    """The SwiGLU feed-forward split over the ranks: gate and up column-parallel, down row-parallel.

    ``forward(x)``: ``x`` ``(..., d_model)``, the same on every rank; returns the full output on
    every rank. One all-reduce forward (``g``, after down) and one backward (``f``, before gate
    and up), each of ``x.numel()`` numbers.
    """

    def __init__(self, gate_proj: ColumnParallelLinear, up_proj: ColumnParallelLinear,
                 down_proj: RowParallelLinear, group=None):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.group = gate_proj, up_proj, down_proj, group

    @classmethod
    def from_mlp(cls, mlp, group=None) -> "TensorParallelMLP":
        """This rank's part of ``mlp`` (``llmu.models.llama.MLP``: ``gate_proj``, ``up_proj``,
        ``down_proj``). ``intermediate_size`` must be divisible by ``W``."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not hasattr(mlp, name):
                raise TypeError(f"mlp must have gate_proj, up_proj and down_proj (llmu.models.llama.MLP), "
                                f"got {type(mlp).__name__} without {name}")
        world, _ = _require_group(group)
        shard_size("intermediate_size", mlp.gate_proj.weight.shape[0], world)
        column = dict(copy_input=False, group=group)
        return cls(ColumnParallelLinear.from_linear(mlp.gate_proj, **column),
                   ColumnParallelLinear.from_linear(mlp.up_proj, **column),
                   RowParallelLinear.from_linear(mlp.down_proj, group=group), group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel(x, self.group)                       # f: one all-reduce backward
        h = silu_mul(self.gate_proj(x), self.up_proj(x))                 # this rank's ffn/W features
        return self.down_proj(h)                                         # g: one all-reduce forward


class TensorParallelAttention(nn.Module):
    """Grouped-query self-attention with RoPE, its heads split over the ranks.

    Rank ``r`` holds query heads ``r*H/W ..`` and KV heads ``r*Hkv/W ..``: with consecutive query
    heads sharing a KV head, these are exactly the KV heads its query heads read, so attention
    runs locally. ``q_proj``, ``k_proj``, ``v_proj`` are column-parallel (the rows of a head are
    contiguous in the weight), ``o_proj`` row-parallel. Both ``H`` and ``Hkv`` must be divisible
    by ``W`` (a KV head cannot be split: its ``head_dim`` channels act together in the dot
    product).

    ``forward(x, cos, sin)``: ``x`` ``(B, T, d_model)`` replicated, ``cos``/``sin`` the RoPE tables
    ``(T, head_dim/2)``, or ``None`` for a NoPE model (``model.rope_tables`` gives ``None`` then:
    nothing is rotated); returns ``(B, T, d_model)`` on every rank, what
    ``llmu.models.llama.Attention`` gives (causal). ``backend``: the name of an attention backend
    (``llmu.models.backends``), llmu's reference ``"naive"`` by default.
    """

    def __init__(self, q_proj, k_proj, v_proj, o_proj, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_layout: str = "half", backend: str = "naive", group=None):
        super().__init__()
        world, _ = _require_group(group)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.local_heads = shard_size("num_heads", num_heads, world)
        self.local_kv_heads = shard_size("num_kv_heads", num_kv_heads, world)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.rope_layout, self.scale, self.group = rope_layout, 1.0 / math.sqrt(head_dim), group
        self.backend = get_attention_backend(backend)

    @classmethod
    def from_attention(cls, attn, *, backend: str = "naive", group=None) -> "TensorParallelAttention":
        """This rank's heads of ``attn`` (``llmu.models.llama.Attention``)."""
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "num_heads", "num_kv_heads", "head_dim"):
            if not hasattr(attn, name):
                raise TypeError(f"attn must be an llmu.models.llama.Attention, got {type(attn).__name__} "
                                f"without {name}")
        world, _ = _require_group(group)
        # refuse before slicing, with the head counts named (not "out_features")
        shard_size("num_heads", attn.num_heads, world)
        shard_size("num_kv_heads", attn.num_kv_heads, world)
        column = dict(copy_input=False, group=group)
        return cls(ColumnParallelLinear.from_linear(attn.q_proj, **column),
                   ColumnParallelLinear.from_linear(attn.k_proj, **column),
                   ColumnParallelLinear.from_linear(attn.v_proj, **column),
                   RowParallelLinear.from_linear(attn.o_proj, group=group),
                   num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                   rope_layout=attn.rope_layout, backend=backend, group=group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x = copy_to_tensor_parallel(x, self.group)                       # f: one all-reduce backward
        # 1. this rank's heads: (B, T, H/W * D) -> (B, H/W, T, D)
        q = self.q_proj(x).view(b, t, self.local_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.local_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.local_kv_heads, self.head_dim).transpose(1, 2)
        # 2. RoPE (none for a NoPE model) and causal attention, per head: nothing to exchange
        if cos is not None:
            q = apply_rope(q, cos, sin, self.rope_layout)
            k = apply_rope(k, cos, sin, self.rope_layout)
        out = self.backend.fn(q, k, v, causal=True, scale=self.scale)
        # 3. this rank's heads through its columns of o_proj; g sums the ranks' partial outputs
        out = out.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim)
        return self.o_proj(out)


class TensorParallelDecoderLayer(nn.Module):
    """A pre-norm decoder layer with tensor-parallel attention and MLP; norms and residuals
    replicated. Two all-reduces forward, two backward: the Megatron count per layer.

    The norm gains need no communication either: the input of each ``f`` is the norm's output,
    whose gradient ``f`` has already summed, so every rank computes the same, full gradient for
    them.
    """

    def __init__(self, input_layernorm, self_attn: TensorParallelAttention, post_attention_layernorm,
                 mlp: TensorParallelMLP):
        super().__init__()
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp

    @classmethod
    def from_layer(cls, layer, *, backend: str = "naive", group=None) -> "TensorParallelDecoderLayer":
        """This rank's part of ``layer`` (``llmu.models.llama.DecoderLayer``); the norms are copied."""
        for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            if not hasattr(layer, name):
                raise TypeError(f"layer must be an llmu.models.llama.DecoderLayer, got {type(layer).__name__}")
        return cls(copy.deepcopy(layer.input_layernorm),
                   TensorParallelAttention.from_attention(layer.self_attn, backend=backend, group=group),
                   copy.deepcopy(layer.post_attention_layernorm),
                   TensorParallelMLP.from_mlp(layer.mlp, group=group))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def megatron_all_reduces(batch: int, seq_len: int, d_model: int, num_layers: int = 1, *,
                         bytes_per_element: int = 4) -> dict:
    """The Megatron analysis of one training step's tensor-parallel traffic, per rank.

    Each layer all-reduces ``B*T*d`` numbers twice forward (after attention's ``o`` and the
    MLP's ``down``) and twice backward (the ``f`` before ``qkv`` and before ``gate``/``up``).
    A ring all-reduce of ``n`` bytes sends ``2 (W-1)/W * n`` bytes from every rank.
    """
    numel = batch * seq_len * d_model
    return {"forward": 2 * num_layers, "backward": 2 * num_layers, "numel_each": numel,
            "bytes_each": numel * bytes_per_element}


# ----------------------------------------------------------------------------------------------
# For the notebook
# ----------------------------------------------------------------------------------------------


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


#: The shape :func:`demo` gives ``tiny_llama``: 8 query heads, 4 KV heads (GQA), so that 1, 2 or 4
#: ranks can share them.
DEMO_MODEL = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=6)


def demo(rank: int, world_size: int, batch: int = 2, seq_len: int = 16, seed: int = 0,
         model_overrides: dict | None = None) -> dict:
    """One tensor-parallel decoder layer, forward and backward, against the unsharded layer.

    Run it with ``llmu.distributed.launch(demo, 2)`` (or 4). Every rank builds the same
    ``tiny_llama(seed, **DEMO_MODEL)`` (``model_overrides`` replaces :data:`DEMO_MODEL`; head
    counts must be divisible by ``W``) and the same input, runs layer 0 whole and its tensor-parallel part, with
    the loss ``<y, dy>``. Returns a dict of largest absolute differences ``y``, ``dx``,
    ``d_shards`` (this rank's weight shards against the slices of the full gradients),
    ``d_norms``, and the communication: ``collectives`` (a list of ``(op, phase, nbytes)``),
    ``forward``/``backward`` (all-reduce counts) and ``expected`` (:func:`megatron_all_reduces`).
    """
    from llmu.models import tiny_llama

    overrides = DEMO_MODEL if model_overrides is None else model_overrides
    model = tiny_llama(seed, **overrides).train().requires_grad_(True)
    full = model.layers[0]
    c = model.config
    g = torch.Generator().manual_seed(seed + 1)
    x_all = torch.randn(batch, seq_len, c.hidden_size, generator=g)
    dy = torch.randn(x_all.shape, generator=g)
    cos, sin = model.rope_tables(0, seq_len)

    # this rank's part of the layer (cut before any backward: the copied norms start without grads)
    layer = TensorParallelDecoderLayer.from_layer(full)

    # the whole layer, on every rank
    x_ref = x_all.clone().requires_grad_()
    y_ref, _ = full(x_ref, cos, sin, backend=get_attention_backend("naive"))
    (y_ref * dy).sum().backward()

    # the tensor-parallel layer, its collectives counted
    x = x_all.clone().requires_grad_()
    with count_communication() as log:
        y = layer(x, cos, sin)
        (y * dy).sum().backward()

    d_shards = 0.0
    pairs = [(layer.self_attn.q_proj, full.self_attn.q_proj, 0), (layer.self_attn.k_proj, full.self_attn.k_proj, 0),
             (layer.self_attn.v_proj, full.self_attn.v_proj, 0), (layer.self_attn.o_proj, full.self_attn.o_proj, 1),
             (layer.mlp.gate_proj, full.mlp.gate_proj, 0), (layer.mlp.up_proj, full.mlp.up_proj, 0),
             (layer.mlp.down_proj, full.mlp.down_proj, 1)]
    for shard, whole, dim in pairs:
        d_shards = max(d_shards, _max_err(shard.weight.grad, whole.weight.grad.chunk(world_size, dim)[rank]))
    d_norms = max(_max_err(layer.input_layernorm.weight.grad, full.input_layernorm.weight.grad),
                  _max_err(layer.post_attention_layernorm.weight.grad, full.post_attention_layernorm.weight.grad))
    return {
        "y": _max_err(y, y_ref), "dx": _max_err(x.grad, x_ref.grad), "d_shards": d_shards, "d_norms": d_norms,
        "collectives": [(op.op, op.phase, op.nbytes) for op in log],
        "forward": sum(op.op == "all_reduce" and op.phase == "forward" for op in log),
        "backward": sum(op.op == "all_reduce" and op.phase == "backward" for op in log),
        "expected": megatron_all_reduces(batch, seq_len, c.hidden_size),
    }
