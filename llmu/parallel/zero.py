"""ZeRO written out: data parallelism that shards what every replica would otherwise duplicate.

Plain data parallelism (``data_parallel.py``) keeps on **every** rank a full copy of the
parameters, the gradients and the optimizer states. For a model of ``Ψ`` parameters trained with
AdamW that is ``(4 + 4 + 8) Ψ = 16 Ψ`` bytes per rank in float32: 4 for the weight, 4 for its
gradient, 8 for Adam's two moments. ZeRO (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models") notices that only the forward and backward need the
whole model, and removes the duplication in three stages. With ``N`` ranks:

- **stage 1**, optimizer states sharded: each rank updates only its ``1/N`` of the parameters, so
  it keeps Adam's moments for that part only, and it needs the average gradient of that part only.
  The backward still builds the whole gradient on every rank; then a **reduce-scatter** gives each
  rank the sum of its own part (the rest of its gradient buffer is spent), each rank updates its
  part, and an **all-gather** gives everyone the new parameters. Memory ``4Ψ + 4Ψ + 8Ψ/N``.
- **stage 2**, gradients sharded too: since a rank reads only its part's gradient, each layer is
  reduce-scattered as soon as its gradients are complete, during the backward, and its full
  gradients are freed right away. Memory ``4Ψ + (4 + 8)Ψ/N``.
- **stage 3**, parameters sharded too: a rank stores only its ``1/N`` of the weights. A layer's
  full weights are **all-gathered just before its forward** (a forward pre-hook), freed right
  after it, gathered again just before its backward (a hook on the gradient of the layer's
  output), and freed again once its gradients have been reduce-scattered. Memory ``16Ψ/N`` plus one
  or two layers' full weights at a time. This is what PyTorch's FSDP does.

What goes on the wire. A ring **all-reduce** *is* a reduce-scatter followed by an all-gather
(:mod:`llmu.parallel.comm`): each rank sends ``(N-1)/N`` of the buffer in each half, ``2Ψ(N-1)/N``
values in all, and that is what plain data parallelism sends per step. Stages 1 and 2 send exactly
that too, only with the optimizer step between the two halves: the reduce-scatter sums the
gradients, the all-gather moves the updated weights instead of the summed gradients. (All-reducing
the whole gradient before the all-gather, as if every rank needed the whole average, would send
``3Ψ(N-1)/N``, 1.5 times as much, and each rank would read only its own part of what it received.)
Stage 3 gathers the weights twice, before the forward and before the backward, and sends
``3Ψ(N-1)/N``: the 1.5 times data parallelism's traffic that the paper pays for ``16Ψ/N``. Stage 0
(plain data parallelism through the same machinery) all-reduces, since every rank updates
everything.

The paper's formulas are for mixed precision: fp16 weights and gradients (2 + 2 bytes) and
``K = 12`` bytes of optimizer state per parameter (an fp32 master copy of the weights and the two
fp32 Adam moments), so baseline ``(2 + 2 + K)Ψ``, stage 1 ``2Ψ + 2Ψ + KΨ/N``, stage 2
``2Ψ + (2 + K)Ψ/N``, stage 3 ``(2 + 2 + K)Ψ/N``. By default everything here is float32: the
weights *are* the master copy, so the weights cost 4 bytes, the gradients 4 and the optimizer
``K = 8`` (the two moments). :func:`zero_memory_formula` computes both settings; :func:`memory_table`
lays them out for a notebook.

Mixed precision (``ZeRO(..., compute_dtype=torch.bfloat16)``, FSDP's ``MixedPrecision``): the
forward and backward run in bf16 (or fp16) on a 2-byte copy of the weights, while the weights the
optimizer updates (the **master** copy), the gradient reduction and the optimizer state stay
float32. Per unit, a rank keeps the flat bf16 buffer the module computes with (stages 0-2: whole,
2Ψ; stage 3: gathered for use only, from the float32 shards cast to bf16, so the all-gather moves 2
bytes a weight) and the float32 master of its own slice (4Ψ/N; 4Ψ in stage 0). Every gradient
arrives in bf16, is upcast to float32 as it is added into the flat gradient, and is averaged in
float32: the paper's 2-byte gradients become 4 here, bought back by sums that do not round to 8
bits of mantissa. After the update, stages 1-2 all-gather the new shards cast to bf16. bf16 has
float32's exponent range and needs no loss scaling; fp16 (5 exponent bits) runs too, on CPU as on
GPU, but its small gradients underflow without loss scaling, which this class does not do.

How the sharding is laid out (the "flat parameter" of FSDP and DeepSpeed): the parameters of each
**unit** (by default every top-level submodule, with ``ModuleList``/``Sequential`` containers
opened, e.g. the embedding, each decoder layer, the final norm, the LM head) are concatenated
into one flat float32 buffer, padded with zeros to a multiple of ``N``; rank ``r`` owns the slice
``[r S, (r+1) S)`` with ``S = padded / N``. The module's parameters become views into the flat
buffer (``p.data = flat[a:b].view(shape)``), so the model runs unchanged. The owned slices are the
parameters of an ordinary optimizer (``torch.optim.AdamW`` unless ``optimizer_cls`` says another):
each rank's optimizer only ever sees its shard, which is all the optimizer-state sharding there is.
SGD, Adam, AdamW and the other element-wise optimizers update each element from that element's
own gradient and state, so updating the shards separately gives exactly the unsharded update.
Optimizers that need a whole tensor (LBFGS, Adafactor, Muon) are refused: a flat slice across
several parameters is not a tensor they could work on. :mod:`llmu.parallel.sharded_optimizer`
does the same optimizer-state sharding (stage 1) for any list of parameters, without hooks.

``zero.parameters()`` are these shards, as with FSDP: an optimizer built on them
(``torch.optim.SGD(zero.parameters(), lr=0.1)``) trains the model. ZeRO sees its step through
PyTorch's global optimizer hooks: before it, the gradients are completed; after it, the new
weights are published. The module's own parameters are views whose gradients never stay in
``.grad``; an optimizer over them would silently change nothing, so its step raises.

Freeing a gathered unit in stage 3 empties the flat buffer's storage
(``untyped_storage().resize_(0)``) rather than dropping the tensor: autograd saved views of the
weights for the backward, and they point at the same storage, which the backward's all-gather
refills before they are read. The parameters' own version counters are untouched (the writes go
through the flat buffer, a different tensor), so autograd does not complain.

Memory is measured, not estimated: :meth:`ZeRO.memory` adds up the storage sizes of the tensors
this rank holds right now (parameters, gradients, optimizer states; a storage shared by several
views counts once), and the wrapper records the peak of that sum during each step (sampled after
every gather, in every gradient hook while autograd's gradient is still alive, and around the
update). Activations are not counted: they are the same for every stage.

**Bit-exact training.** The gradient of a step is the average of the ranks' gradients, and how
that sum is ordered decides its last bits. By default the sum is taken in rank order
(``reduce_order="rank"``, :mod:`llmu.parallel.ordered_reduce`), as one process accumulating the
ranks' micro-batches one after the other would take it; AdamW and the other element-wise
optimizers then update each element exactly as the unsharded optimizer does, so every stage ends
at parameters ``torch.equal`` to that process's, on any number of ranks. One backward over the
whole batch at once is a different computation (its matrix products sum over all the tokens in
their own blocking) and stays a few ulps away.

Call order matters as in any data parallelism: every rank runs the same forward and backward, so
the collectives issued from the hooks pair up. A unit none of whose parameters received a
gradient on any rank is skipped; a unit some of whose parameters got none is completed with zeros.

Compared with PyTorch: :func:`fsdp2_train` trains the same model with FSDP2
(``torch.distributed.fsdp.fully_shard``, one call per unit and one on the root, the same optimizer),
which runs on CPU with gloo in this PyTorch; the tests check that ZeRO-3 and FSDP2 end at the same
parameters. FSDP2 shards each parameter along its first dimension (a ``DTensor`` per parameter)
instead of one flat buffer per unit: a different layout of the same idea.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from llmu.parallel.data_parallel import (
    accumulated_steps,
    broadcast_module,
    next_token_loss,
    require_process_group,
    single_process_steps,
    tensors_in,
)
from llmu.parallel.ordered_reduce import all_reduce_in_rank_order, check_reduce_order, reduce_scatter_in_rank_order
from llmu.parallel.sharded_optimizer import _claim, _owner, _release, check_optimizer_class

__all__ = ["STAGES", "PRECISIONS", "COMPUTE_DTYPES", "ZeRO", "FlatUnit", "default_units", "zero_memory_formula",
           "memory_table", "fsdp2_train", "demo"]

#: 0 is plain data parallelism through the same machinery (the baseline of the table).
STAGES = (0, 1, 2, 3)

#: Bytes per parameter of (weights, gradients, optimizer states) for AdamW.
PRECISIONS = {"float32": (4, 4, 8), "mixed": (2, 2, 12)}

# Newer PyTorch names the single-tensor collectives *_single; older ones *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ----------------------------------------------------------------------------------------------
# The formulas
# ----------------------------------------------------------------------------------------------


def zero_memory_formula(num_params: int, world_size: int, stage: int, precision: str = "float32") -> dict:
    """Bytes per rank for parameters, gradients and optimizer states (and their ``total``) under
    ZeRO ``stage`` (0 = plain data parallelism), after Rajbhandari et al. 2020.

    ``precision="float32"``: 4-byte weights, 4-byte gradients, 8 bytes of Adam moments.
    ``precision="mixed"``: the paper's 2 + 2 + K with K = 12 (fp32 master weights + two moments).
    """
    for name, value in (("num_params", num_params), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    w, g, k = PRECISIONS[precision]
    n = world_size
    params = w * num_params / (n if stage >= 3 else 1)
    grads = g * num_params / (n if stage >= 2 else 1)
    optimizer = k * num_params / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def memory_table(num_params: int, world_size: int, precision: str = "float32",
                 measured: dict | None = None) -> list[dict]:
    """One row per stage: the formula's bytes per rank, and where ``measured`` gives them
    (``{stage: ZeRO.memory() dict}``), the measured bytes beside them (``measured_*`` keys)."""
    rows = []
    for stage in STAGES:
        row = {"stage": stage, **zero_memory_formula(num_params, world_size, stage, precision)}
        if measured is not None and stage in measured:
            row.update({f"measured_{key}": measured[stage][key] for key in ("params", "grads", "optimizer", "total")})
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# Units and their flat buffers
# ----------------------------------------------------------------------------------------------


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def default_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, submodule)`` for the top-level submodules that hold trainable parameters, opening
    ``ModuleList``/``ModuleDict``/``Sequential`` containers (one unit per decoder layer)."""

    def walk(m: nn.Module, prefix: str):
        for name, child in m.named_children():
            if isinstance(child, _CONTAINERS):
                yield from walk(child, f"{prefix}{name}.")
            elif any(p.requires_grad for p in child.parameters()):
                yield f"{prefix}{name}", child

    return list(walk(module, ""))


@dataclasses.dataclass(eq=False)
class FlatUnit:
    """The parameters of one unit as a flat buffer, and this rank's shard of it."""

    name: str
    module: nn.Module
    names: list[str]                # the parameters' names in the wrapped module
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int                      # real elements
    padded: int                     # numel rounded up to a multiple of world_size
    full: torch.Tensor              # (padded,) all the weights, in the compute dtype; stage 3: emptied between uses
    shard: nn.Parameter             # float32, what this rank's optimizer updates (a view of full when both are
                                    # float32 and the stage is 0-2; otherwise the master copy of the owned slice)
    owned: slice                    # the shard's place in the flat buffer
    full_grad: torch.Tensor | None = None   # (padded,) stages 0-1: kept (stage 1: once reduce-scattered,
                                            # only the owned slice is meaningful); 2-3: only during backward
    carry: torch.Tensor | None = None       # stage 1: the averaged shard gradient of a reduction this step,
                                            # set aside while more gradients accumulate before the step
    ready: int = 0                  # gradients received in this backward
    gathered: bool = True


def _owned_range(stage: int, padded: int, world: int, rank: int) -> slice:
    if stage == 0:                  # plain data parallelism: everyone updates everything
        return slice(0, padded)
    size = padded // world
    return slice(rank * size, (rank + 1) * size)


# ----------------------------------------------------------------------------------------------
# The wrapper
# ----------------------------------------------------------------------------------------------

#: The dtypes forward and backward may run in (``compute_dtype``); None (or float32) means float32.
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


def _check_compute_dtype(compute_dtype) -> torch.dtype:
    if compute_dtype is None or compute_dtype is torch.float32:
        return torch.float32
    if not isinstance(compute_dtype, torch.dtype):
        raise TypeError(f"compute_dtype must be a torch.dtype (torch.bfloat16 or torch.float16), or None for "
                        f"float32 throughout; got {compute_dtype!r}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be torch.bfloat16 or torch.float16 (or None / torch.float32: no "
                         f"mixed precision); got {compute_dtype}")
    return compute_dtype


def _cast_floats(obj, dtype: torch.dtype):
    """``obj`` with its floating-point tensors (inside tuples, lists and dicts too) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast_floats(item, dtype) for item in obj)
    if isinstance(obj, dict):
        return {key: _cast_floats(value, dtype) for key, value in obj.items()}
    return obj


class ZeRO(nn.Module):
    """``module`` trained under ZeRO ``stage`` (0-3) on every rank of ``group``, with any
    element-wise optimizer (AdamW unless told otherwise).

    Build it on every rank at once: rank 0's weights are broadcast, then each unit's parameters
    are moved into a flat buffer and sharded. Per step::

        loss = loss_fn(zero(my_shard))      # stage 3 gathers each unit just in time
        loss.backward()                     # stages 2-3 reduce-scatter each unit when complete
        zero.step()                         # stage 1: reduce-scatter (stage 0: all-reduce), update
                                            # the shard, all-gather (stages 1-2)
        zero.zero_grad()

    ``optimizer_cls`` and ``**optimizer_kwargs``: the optimizer and its keyword arguments,
    ``ZeRO(model, 2, torch.optim.SGD, lr=0.1, momentum=0.9)``; the default is
    ``torch.optim.AdamW`` with its own defaults (``lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.01``), so ``ZeRO(model, 1, lr=1e-2)`` is AdamW. It must update each element
    from that element alone (see :func:`~llmu.parallel.sharded_optimizer.check_optimizer_class`;
    ``assume_elementwise=True`` vouches for a class it does not know).

    ``reduce_order``: ``"rank"`` (default) sums the ranks' gradients in rank order,
    ``((g0 + g1) + g2) + ...`` (:mod:`llmu.parallel.ordered_reduce`: an all-to-all, then the sum on
    the receiving rank), the order of one process accumulating the same micro-batches, so float32
    training is bit-identical to it on any number of ranks; ``"collective"`` uses the backend's
    reduce-scatter (stage 0: its all-reduce), whose order differs from 3 ranks on (a few ulps per
    step).

    ``units``: submodules whose parameters form one flat buffer each (default
    :func:`default_units`); trainable parameters outside them form one more unit around the whole
    module. All trainable parameters must be float32.

    ``compute_dtype`` (``torch.bfloat16`` or ``torch.float16``): mixed precision, as FSDP's
    ``MixedPrecision(param_dtype=..., reduce_dtype=torch.float32)``. The module's parameters become
    ``compute_dtype`` views and floating-point inputs are cast, so forward and backward run in
    ``compute_dtype``; the shards the optimizer updates are float32 master weights; every gradient
    is upcast to float32 as it arrives and reduced in float32; the optimizer state is float32.
    Frozen parameters and buffers are left as they are. The output comes out in
    ``compute_dtype``.

    What a rank holds, ``Ψ`` parameters, ``N`` ranks, AdamW (``memory()`` measures it):

    ==========  ====================  ==========================  ===============================
    stage       weights               gradients (float32)         optimizer
    ==========  ====================  ==========================  ===============================
    0           4Ψ   (bf16: 2Ψ)       4Ψ                          8Ψ   (bf16: + 4Ψ master)
    1           4Ψ   (bf16: 2Ψ)       4Ψ                          8Ψ/N (bf16: + 4Ψ/N master)
    2           4Ψ   (bf16: 2Ψ)       4Ψ/N                        8Ψ/N (bf16: + 4Ψ/N master)
    3           4Ψ/N (bf16: 0)        4Ψ/N                        8Ψ/N (bf16: + 4Ψ/N master)
    ==========  ====================  ==========================  ===============================

    plus, during the backward of stages 2-3, the full float32 gradient of the unit being reduced,
    and in stage 3 one or two units' gathered weights at a time. Stage 1 keeps the whole gradient
    through the backward; its reduce-scatter then leaves the average in this rank's slice only.
    Under mixed precision the float32 master weights count as optimizer state, as the ZeRO paper's
    ``K = 12`` does. For ``Ψ = 1e9, N = 8``: stage 1 in float32 is 4 + 4 + 1 = 9 GB, with bf16
    compute 2 + 4 + 1.5 = 7.5 GB (the paper's 2 + 2 + 1.5 reduces gradients in 16 bits; this class
    reduces in float32).

    What a rank sends per step (``Ψ`` padded, float32): ``2(N-1)/N · 4Ψ`` bytes in stages 0-2, plain
    data parallelism's all-reduce (stage 0 all-reduces; stages 1 and 2 reduce-scatter the gradients
    and all-gather the updated weights), and ``3(N-1)/N · 4Ψ`` in stage 3 (two all-gathers of the
    weights and a reduce-scatter). Under mixed precision the all-gathers move 2-byte weights.

    ``parameters()`` / ``named_parameters()`` are the shards this rank owns and updates (one flat
    float32 tensor per unit, ``"<unit>.flat_shard"``), as with FSDP: an optimizer built on them,
    ``torch.optim.SGD(zero.parameters(), lr=0.1)``, trains the model, every stage. Its ``step``
    first completes the gradients (:meth:`reduce_gradients`) and afterwards gives every rank the
    new weights (stages 1-2 all-gather; stage 3 gathers in the next forward). The module's own
    parameters (``zero.module.parameters()``) are views ZeRO manages: their ``.grad`` never stays,
    so an optimizer over them would change nothing, and its ``step`` raises instead.

    Gradients accumulate over several backward passes until a step; the first backward after a
    step starts from zero, whatever ``zero_grad`` did or did not do (as DeepSpeed's engine).

    Checkpoints: :meth:`state_dict` gives what one process's ``module.state_dict()`` would hold
    (full float32 parameters, gathered: a collective), and :meth:`load_state_dict` takes such a dict
    back on every rank; the optimizer's sharded state is saved per rank
    (``zero.optimizer.state_dict()``).

    Attributes: ``units`` (the :class:`FlatUnit` list), ``optimizer`` (over the shards),
    ``compute_dtype``, ``peak`` (the largest :meth:`memory` seen since the last :meth:`zero_grad`,
    per category), ``events`` (stage 3: ``(seconds, "gather (forward)" | "gather (backward)" |
    "free", unit name)`` since the last :meth:`zero_grad`, or the last step's).
    """

    def __init__(self, module: nn.Module, stage: int, optimizer_cls=torch.optim.AdamW, *,
                 units: list[nn.Module] | None = None, group=None, compute_dtype=None,
                 assume_elementwise: bool = False, reduce_order: str = "rank", **optimizer_kwargs):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(stage, bool) or stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        check_optimizer_class(optimizer_cls, optimizer_kwargs, assume_elementwise=assume_elementwise, what="ZeRO")
        self.compute_dtype = _check_compute_dtype(compute_dtype)
        self.reduce_order = check_reduce_order(reduce_order)
        self.mixed = self.compute_dtype != torch.float32
        self.assume_elementwise = assume_elementwise
        # Step 1: which parameters go in which unit
        named_units = self._resolve_units(module, units)
        self.world_size, self.rank = require_process_group(group, "ZeRO")
        _claim([p for _, _, params in named_units for p in params], self)
        self.module, self.stage, self.group = module, stage, group
        broadcast_module(module, group)
        full_names = {p: n for n, p in module.named_parameters()}
        self.units = [self._flatten(name, unit_module, params, full_names) for name, unit_module, params in named_units]
        self._where = {p: (u, i) for u in self.units for i, p in enumerate(u.params)}
        self._shard_ids = {id(u.shard) for u in self.units}
        _claim([u.shard for u in self.units], self)

        # Step 2: the optimizer sees the shards only
        self.optimizer = optimizer_cls([u.shard for u in self.units], **optimizer_kwargs)
        _install_optimizer_hooks()

        # Step 3: hooks: gradients into the flat buffers; stage 3 gathers and frees around uses
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready)
                         for u in self.units for p in u.params]
        if stage == 3:
            for u in self.units:
                self._handles.append(u.module.register_forward_pre_hook(self._before_forward_hook(u)))
                self._handles.append(u.module.register_forward_hook(self._after_forward_hook(u)))
        self._t0 = time.perf_counter()
        self._reduced = False           # this step's gradients are averaged already
        self._stepped = False           # a step has used the gradients: the next backward starts from zero
        self._events_stale = False      # a step has happened: the next forward starts a new event list
        self.events: list[tuple[float, str, str]] = []
        self.peak = self.memory()

    # -- construction -------------------------------------------------------------------------------
    @staticmethod
    def _resolve_units(module, units):
        if units is None:
            pairs = default_units(module)
        else:
            if not isinstance(units, (list, tuple)) or not all(isinstance(m, nn.Module) for m in units):
                raise TypeError("units must be a list of submodules of module")
            names = {id(m): n for n, m in module.named_modules()}
            missing = [type(m).__name__ for m in units if id(m) not in names]
            if missing:
                raise ValueError(f"units must be submodules of module; not found: {missing}")
            pairs = [(names[id(m)], m) for m in units]
        owner: dict[nn.Parameter, str] = {}
        result = []
        for name, m in pairs:
            params = []
            for p in m.parameters():
                if not p.requires_grad:
                    continue
                if p in owner:
                    raise ValueError(f"a parameter of unit {name!r} also belongs to unit {owner[p]!r} (tied or "
                                     f"nested units): every trainable parameter must belong to exactly one unit")
                owner[p] = name
                params.append(p)
            if params:
                result.append((name, m, params))
        rest = [p for p in module.parameters() if p.requires_grad and p not in owner]
        if rest:
            result.append(("<root>", module, rest))
        if not result:
            raise ValueError("module has no parameter with requires_grad=True: nothing to train "
                             "(call module.requires_grad_(True))")
        for _, _, params in result:
            for p in params:
                if p.dtype != torch.float32:
                    raise TypeError(f"ZeRO here trains float32 parameters (for lower-precision compute, keep them "
                                    f"float32 and pass compute_dtype); got one of dtype {p.dtype}")
        return result

    def _flatten(self, name: str, unit_module: nn.Module, params: list[nn.Parameter], full_names: dict) -> FlatUnit:
        offsets, numel = [], 0
        for p in params:
            offsets.append(numel)
            numel += p.numel()
        padded = -(-numel // self.world_size) * self.world_size
        master = torch.zeros(padded, dtype=torch.float32, device=params[0].device)
        with torch.no_grad():
            for p, off in zip(params, offsets):
                master[off:off + p.numel()].copy_(p.reshape(-1))
        owned = _owned_range(self.stage, padded, self.world_size, self.rank)
        if self.mixed or self.stage == 3:
            shard = nn.Parameter(master[owned].clone())         # the only float32 copy this rank keeps
            full = master.to(self.compute_dtype)                # what the module computes with
        else:
            full = master
            shard = nn.Parameter(full[owned])                   # a view: updates land in the module
        for p, off in zip(params, offsets):
            p.data = full[off:off + p.numel()].view(p.shape)   # the module now reads the flat buffer
        if self.stage == 3:
            full.untyped_storage().resize_(0)
        unit = FlatUnit(name, unit_module, [full_names[p] for p in params], params, offsets, numel, padded,
                        full, shard, owned, gathered=self.stage != 3)
        if self.stage <= 1:
            unit.full_grad = torch.zeros(padded, dtype=torch.float32, device=full.device)
            shard.grad = unit.full_grad[owned]
        else:
            shard.grad = torch.zeros_like(shard)
        return unit

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        """``Ψ``: trainable parameters."""
        return sum(u.numel for u in self.units)

    @property
    def padded_params(self) -> int:
        """``Ψ`` after padding every unit to a multiple of the world size."""
        return sum(u.padded for u in self.units)

    # -- what this rank trains --------------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The shards this rank owns and updates, one flat float32 tensor per unit, named
        ``"<unit>.flat_shard"`` (``"flat_shard"`` for the parameters outside every unit). An
        optimizer built on them trains the model; see the class docstring."""
        for unit in getattr(self, "units", []):
            yield prefix + ("flat_shard" if unit.name == "<root>" else f"{unit.name}.flat_shard"), unit.shard

    def _is_shard(self, p: torch.Tensor) -> bool:
        return id(p) in self._shard_ids

    # -- stage 3: gather just in time, free after use ---------------------------------------------
    def _event(self, kind: str, unit: FlatUnit) -> None:
        self.events.append((time.perf_counter() - self._t0, kind, unit.name))

    def _compute_copy(self, shard: torch.Tensor) -> torch.Tensor:
        """What a rank sends to the all-gather: its shard in the compute dtype (a new tensor)."""
        return shard.detach().to(self.compute_dtype) if self.mixed else shard.detach().clone()

    def _gather(self, unit: FlatUnit, phase: str) -> None:
        if unit.gathered:
            return
        unit.full.untyped_storage().resize_(unit.padded * unit.full.element_size())
        _all_gather(unit.full, self._compute_copy(unit.shard), group=self.group)
        unit.gathered = True
        self._event(f"gather ({phase})", unit)
        self._sample()

    def _free(self, unit: FlatUnit) -> None:
        if unit.gathered:
            unit.full.untyped_storage().resize_(0)
            unit.gathered = False
            self._event("free", unit)

    def _before_forward_hook(self, unit: FlatUnit):
        def hook(module, args) -> None:
            self._gather(unit, "forward")
        return hook

    def _after_forward_hook(self, unit: FlatUnit):
        def hook(module, args, output) -> None:
            # gather again when the gradient of this unit's output arrives: its backward comes next
            if torch.is_grad_enabled():
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(lambda grad: self._gather(unit, "backward"))
            self._free(unit)
        return hook

    # -- gradients --------------------------------------------------------------------------------
    def _grad_ready(self, p: torch.Tensor) -> None:
        """Hook: ``p.grad`` is complete. Add it into the unit's flat float32 gradient (upcast on the
        fly under mixed precision), free it, and once the whole unit is in, reduce-scatter it
        (stages 2-3)."""
        if self._stepped:                           # the first gradient after a step: start from zero
            self._clear_gradients(keep_param_grads=True)
        if self._reduced and self.stage == 1:       # more gradients after a reduction, before the step
            self._set_aside_reduced()
        self._reduced = False
        unit, i = self._where[p]
        self._attach_grad(unit)
        if unit.full_grad is None:
            unit.full_grad = torch.zeros(unit.padded, dtype=torch.float32, device=unit.shard.device)
        with torch.no_grad():
            unit.full_grad[unit.offsets[i]:unit.offsets[i] + p.numel()].add_(p.grad.reshape(-1))
        self._sample()                              # autograd's gradient and ours both alive
        p.grad = None
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._unit_done(unit)

    def _attach_grad(self, unit: FlatUnit) -> None:
        """Give the shard its gradient back if it has none: an optimizer's
        ``zero_grad(set_to_none=True)`` sets ``shard.grad = None``, which means zero. Stages 0-1:
        the shard's gradient is its slice of the flat gradient (zeroed with it), where stage 1's
        reduce-scatter writes the average; stages 2-3: a zero tensor that the reduce-scatter adds
        into."""
        if unit.shard.grad is not None:
            return
        if self.stage <= 1:
            unit.full_grad.zero_()
            unit.carry = None
            unit.shard.grad = unit.full_grad[unit.owned]
        else:
            unit.shard.grad = torch.zeros_like(unit.shard)

    def _reduce_scatter_unit(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's slice of the average over the ranks of the unit's flat gradient, in a new
        tensor: a reduce-scatter (each rank receives the sum of its own slice only), then ``/ W``.
        A collective: every rank calls it, for the same unit."""
        mine = torch.empty_like(unit.shard)
        if self.reduce_order == "rank":             # summed g0 + g1 + ... in rank order: exact
            reduce_scatter_in_rank_order(mine, unit.full_grad, self.group)
        else:
            _reduce_scatter(mine, unit.full_grad, group=self.group)
        return mine.div_(self.world_size)

    def _unit_done(self, unit: FlatUnit) -> None:
        unit.ready = 0
        if self.stage <= 1:                         # the full gradient stays until the step
            return
        # Each rank receives the sum of its own slice only; then the full gradient goes
        unit.shard.grad.add_(self._reduce_scatter_unit(unit))
        self._sample()
        unit.full_grad = None
        if self.stage == 3:
            self._free(unit)

    def _clear_gradients(self, keep_param_grads: bool = False) -> None:
        """Every flat and shard gradient to zero (or ``None`` where a backward recreates it); the
        parameters' own ``.grad`` too, unless a gradient hook is about to read one."""
        for unit in self.units:
            self._attach_grad(unit)                 # a gradient set to None counts as zero
            unit.carry = None
            if self.stage <= 1:
                unit.full_grad.zero_()
            else:
                unit.full_grad = None
                unit.shard.grad.zero_()
            unit.ready = 0
            if not keep_param_grads:
                for p in unit.params:
                    p.grad = None
        self._reduced = False
        self._stepped = False

    # -- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Finish the gradient communication of this step: stage 0 all-reduces the full gradients
        (every rank updates everything); stage 1 reduce-scatters them, so that each rank receives
        the sum of its own slice only, into that slice of its flat gradient; stages 2-3 have
        reduce-scattered every complete unit during the backward and complete the others here.
        Each divides by ``W``. Afterwards ``unit.shard.grad`` holds the average gradient of this
        rank's shard (stage 1: the rest of the flat gradient is spent, this rank's own unreduced
        values). :meth:`step` (and the step of any optimizer over :meth:`parameters`) calls it;
        calling it again before new gradients arrive does nothing."""
        if self._reduced:
            return
        for unit in self.units:                     # units some of whose parameters got no gradient
            self._attach_grad(unit)
            if unit.ready:
                self._unit_done(unit)
            if self.stage == 3:
                self._free(unit)
        if self.stage == 0:                         # plain data parallelism: the whole average everywhere
            for unit in self.units:
                if self.reduce_order == "rank":
                    all_reduce_in_rank_order(unit.full_grad, self.group)
                else:
                    dist.all_reduce(unit.full_grad, group=self.group)
                unit.full_grad.div_(self.world_size)
        elif self.stage == 1:                       # the first half of an all-reduce; the all-gather of
            for unit in self.units:                 # the updated weights (_publish) is the second
                mine = self._reduce_scatter_unit(unit)
                if unit.carry is not None:          # an earlier reduction of this step: add to it
                    mine = unit.carry.add_(mine)
                    unit.carry = None
                unit.shard.grad.copy_(mine)         # this rank's slice of the flat gradient
            self._sample()
        self._reduced = True

    def _set_aside_reduced(self) -> None:
        """Stage 1, a gradient arrives after :meth:`reduce_gradients` and before the step (say,
        after :meth:`full_gradients`): keep the average of each shard aside and start the flat
        gradient from zero, so that the next reduction sums the new gradients only and adds them
        to it, as stage 2 adds each reduce-scatter into its shard gradient."""
        for unit in self.units:
            if unit.shard.grad is not None:         # None (an optimizer's zero_grad) means zero: nothing to keep
                unit.carry = unit.shard.grad.clone()
                unit.full_grad.zero_()

    @torch.no_grad()
    def _publish(self) -> None:
        """After the shards changed: give every rank the new weights it computes with. Stage 0:
        each rank updated everything (under mixed precision, cast the master into the compute
        copy); stages 1-2: all-gather the shards (in the compute dtype); stage 3: nothing, the
        next forward gathers."""
        if self.stage == 3:
            pass
        elif self.stage == 0:
            if self.mixed:
                for unit in self.units:
                    unit.full.copy_(unit.shard)
        else:
            for unit in self.units:
                _all_gather(unit.full, self._compute_copy(unit.shard), group=self.group)
        self._stepped = self._events_stale = True

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients (:meth:`reduce_gradients`), update this rank's shard with the
        optimizer, and give everyone the new weights (stages 1-2: all-gather; stage 3: the next
        forward gathers them)."""
        self.reduce_gradients()
        self.optimizer.step()
        self._sample()
        self._publish()

    def zero_grad(self) -> None:
        """Clear the gradients (the flat ones and the shards') and start a new peak measurement."""
        self._clear_gradients()
        self.events = []
        self._events_stale = False
        self._t0 = time.perf_counter()
        self.peak = self.memory()

    def forward(self, *args, **kwargs):
        if self._events_stale:                      # no zero_grad since the last step: a new event list
            self.events, self._events_stale, self._t0 = [], False, time.perf_counter()
        if self.mixed:
            args, kwargs = _cast_floats(args, self.compute_dtype), _cast_floats(kwargs, self.compute_dtype)
        return self.module(*args, **kwargs)

    # -- measuring --------------------------------------------------------------------------------
    def memory(self) -> dict:
        """Bytes this rank holds right now: ``params``, ``grads``, ``optimizer`` and ``total``.

        The sum of the storage sizes of the tensors involved (a storage shared by several views is
        counted once, under the first category that holds it; an emptied stage-3 buffer counts 0).
        ``params``: the weights the module computes with (and, in float32, the shards);
        ``optimizer``: every tensor of the state of ``self.optimizer`` (AdamW: the two moments and
        one 4-byte step counter per shard; an optimizer you built over :meth:`parameters` keeps
        its own, not counted here) and, under mixed precision, the float32 master shards.
        """
        seen: set[int] = set()

        def size(tensors) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        shards = [u.shard for u in self.units]
        params = size([p for u in self.units for p in u.params] + [u.full for u in self.units]
                      + ([] if self.mixed else shards))
        grads = size([p.grad for u in self.units for p in u.params] + [u.full_grad for u in self.units]
                     + [u.shard.grad for u in self.units] + [u.carry for u in self.units])
        optimizer = size([t for state in self.optimizer.state.values() for t in state.values()
                          if isinstance(t, torch.Tensor)] + (shards if self.mixed else []))
        return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}

    def _sample(self) -> None:
        now = self.memory()
        self.peak = {key: max(self.peak[key], now[key]) for key in now}

    @torch.no_grad()
    def _gathered_flat(self, unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
        """The whole float32 flat tensor whose rank slices are ``shard`` (a collective unless stage 0)."""
        if self.stage == 0:
            return shard.detach()
        flat = torch.empty(unit.padded, dtype=torch.float32, device=shard.device)
        _all_gather(flat, shard.detach().contiguous(), group=self.group)
        return flat

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """A float32 copy of every trained parameter, full size, by its name in ``module`` (under
        mixed precision the master weights, not their ``compute_dtype`` copies). A collective in
        stage 3 and under mixed precision: every rank must call it."""
        out = {}
        for unit in self.units:
            if self.mixed or self.stage == 3:       # the float32 weights exist as shards only
                flat = self._gathered_flat(unit, unit.shard)
                for name, p, off in zip(unit.names, unit.params, unit.offsets):
                    out[name] = flat[off:off + p.numel()].view(p.shape).clone()
            else:
                for name, p in zip(unit.names, unit.params):
                    out[name] = p.detach().clone()
        return out

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The average float32 gradient of every trained parameter over the ranks, in the
        parameter's shape, by its name in ``module``: what a single process would hold in
        ``p.grad`` (upcast to float32 under mixed precision). Call it after the backward and
        before the step; it completes the reduction (:meth:`reduce_gradients`) and, in stages 1-3,
        all-gathers the gradient shards: a collective, every rank must call it. Every rank gets
        the same bits: each slice is summed once, by its owner (stages 1-3), or by one all-reduce
        whose result every rank receives (stage 0)."""
        self.reduce_gradients()
        out = {}
        for unit in self.units:
            flat = self._gathered_flat(unit, unit.shard.grad)   # stage 0: the all-reduced flat gradient
            for name, p, off in zip(unit.names, unit.params, unit.offsets):
                out[name] = flat[off:off + p.numel()].view(p.shape).clone()
        return out

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """The wrapped module's state as one process would save it: ``module.state_dict()``'s keys,
        with every trained parameter full size and float32 (under mixed precision the master
        weights, not their ``compute_dtype`` copies), buffers and frozen parameters as they are.
        A collective in stage 3 and under mixed precision (:meth:`full_parameters`): every rank
        calls it, and every rank gets the same dict, ready for ``torch.save`` by one of them.

        Without this, ``nn.Module.state_dict`` would hand out the module's own parameters, which
        are views into ZeRO's flat buffers: in stage 3 their storage is empty between uses, and
        under mixed precision they hold the rounded bf16/fp16 copies. The optimizer's state is
        not in it: it is sharded, ``zero.optimizer.state_dict()`` on each rank."""
        if args:
            raise TypeError("ZeRO.state_dict takes keyword arguments only (destination=, prefix=, keep_vars=)")
        full = self.full_parameters()
        out = {}
        for name, value in self.module.state_dict(keep_vars=keep_vars).items():
            out[prefix + name] = full[name] if name in full else value
        if destination is not None:
            destination.update(out)
            return destination
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a :meth:`state_dict` (or a single process's ``module.state_dict()``: the same
        keys) on every rank: each trained parameter goes into this rank's float32 shard and the
        weights the module computes with (stages 0-2; stage 3 gathers them at the next forward),
        buffers and frozen parameters into the module. Every rank must load the same dict. With
        ``strict``, missing or unexpected keys raise, as in ``nn.Module.load_state_dict``.
        Returns ``(missing_keys, unexpected_keys)``."""
        if assign:
            raise ValueError("ZeRO.load_state_dict copies into its flat buffers; assign=True is not supported")
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")
        trained = {name for unit in self.units for name in unit.names}
        expected = set(self.module.state_dict().keys())
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(f"ZeRO.load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for unit in self.units:
            present = [n in state_dict for n in unit.names]
            if not any(present):
                continue
            if not all(present):
                raise ValueError(f"unit {unit.name!r} is one flat buffer: load all its parameters or none, "
                                 f"missing {[n for n, ok in zip(unit.names, present) if not ok]}")
            flat = torch.zeros(unit.padded, dtype=torch.float32, device=unit.shard.device)
            for name, p, off in zip(unit.names, unit.params, unit.offsets):
                value = state_dict[name]
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: the checkpoint holds shape {tuple(value.shape)}, the model "
                                     f"{tuple(p.shape)}")
                flat[off:off + p.numel()].copy_(value.reshape(-1))
            unit.shard.copy_(flat[unit.owned])          # the float32 weights this rank updates
            if unit.gathered:                           # stages 0-2: the weights the module computes with
                unit.full.copy_(flat)                   # (stage 3 gathers the new shards at the next forward)
        rest = {k: v for k, v in state_dict.items() if k not in trained}
        self.module.load_state_dict(rest, strict=False)
        return missing, unexpected

    def remove_hooks(self) -> None:
        """Detach the gradient and (stage 3) forward hooks from the module (the wrapper stops working)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        _release([p for u in self.units for p in [*u.params, u.shard]], self)

    def extra_repr(self) -> str:
        dtype = f", compute_dtype={self.compute_dtype}" if self.mixed else ""
        return (f"stage={self.stage}, optimizer={type(self.optimizer).__name__}{dtype}, world_size={self.world_size}, "
                f"rank={self.rank}, units={len(self.units)}, params={self.num_params} (padded {self.padded_params})")


# ----------------------------------------------------------------------------------------------
# Optimizers built over zero.parameters()
# ----------------------------------------------------------------------------------------------

_optimizer_hooks = None


def _install_optimizer_hooks() -> None:
    """Once per process: a hook before and after every optimizer step (PyTorch's global step
    hooks). They act only on optimizers holding tensors a :class:`ZeRO` manages, ZeRO's own
    optimizer excepted: before the step, complete the gradients; after it, publish the weights."""
    global _optimizer_hooks
    if _optimizer_hooks is None:
        _optimizer_hooks = (register_optimizer_step_pre_hook(_before_any_step),
                            register_optimizer_step_post_hook(_after_any_step))


def _zeros_of(optimizer) -> list[ZeRO]:
    """The ZeRO wrappers whose shards ``optimizer`` holds (raising if it holds their views)."""
    found: list[ZeRO] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            zero = _owner(p)
            if not isinstance(zero, ZeRO) or zero.optimizer is optimizer:
                continue
            if not zero._is_shard(p):
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds a parameter of shape {tuple(p.shape)} that ZeRO (stage "
                    f"{zero.stage}) manages: ZeRO moves its gradient into flat buffers and leaves .grad empty, so "
                    "this step would change nothing. Build the optimizer over zero.parameters() (the shards this "
                    "rank updates), or let ZeRO build it: ZeRO(module, stage, torch.optim.SGD, lr=...)")
            if all(zero is not z for z in found):
                found.append(zero)
    return found


def _before_any_step(optimizer, args, kwargs) -> None:
    for zero in _zeros_of(optimizer):
        check_optimizer_class(type(optimizer), None, assume_elementwise=zero.assume_elementwise, what="ZeRO")
        zero.reduce_gradients()


def _after_any_step(optimizer, args, kwargs) -> None:
    for zero in _zeros_of(optimizer):
        zero._sample()
        zero._publish()


# ----------------------------------------------------------------------------------------------
# PyTorch's FSDP2, for comparison
# ----------------------------------------------------------------------------------------------


def fsdp2_train(module: nn.Module, batches: list[torch.Tensor], *, optimizer_cls=torch.optim.AdamW,
                units: list[nn.Module] | None = None, loss_fn=next_token_loss, group=None,
                **optimizer_kwargs) -> dict[str, torch.Tensor]:
    """Train ``module`` one optimizer step per batch of ``batches`` (this rank's shards) with
    PyTorch's FSDP2: ``fully_shard`` on every unit (default :func:`default_units`), then on the
    root. Returns the full parameters afterwards (``DTensor.full_tensor()``, a collective), by name.

    ``optimizer_cls`` and ``**optimizer_kwargs``: the optimizer, as for :class:`ZeRO`; the default
    is ``torch.optim.AdamW`` with its own defaults (``lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.01``). FSDP2 hands the optimizer ``DTensor`` shards, one per parameter (each
    keeps its shape, cut along the first dimension), so an optimizer that updates element by
    element gives the unsharded result.

    ``module`` is modified in place (its parameters become ``DTensor`` shards). Rank 0's weights
    are broadcast first, as :class:`ZeRO` does.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, "
                        f"got {optimizer_cls!r}")
    world, _ = require_process_group(group, "FSDP2")
    broadcast_module(module, group)
    device_type = next(module.parameters()).device.type
    mesh = init_device_mesh(device_type, (world,))
    for m in (units if units is not None else [m for _, m in default_units(module)]):
        fully_shard(m, mesh=mesh)
    fully_shard(module, mesh=mesh)
    opt = optimizer_cls(module.parameters(), **optimizer_kwargs)
    for batch in batches:
        loss_fn(module, batch).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.full_tensor().detach().clone() for name, p in module.named_parameters()}


# ----------------------------------------------------------------------------------------------
# For the notebook
# ----------------------------------------------------------------------------------------------


def _tiny_model(seed: int, **overrides) -> nn.Module:
    from llmu.models import tiny_llama

    return tiny_llama(seed, **overrides).train().requires_grad_(True)


def demo(rank: int, world_size: int, steps: int = 3, batch_per_rank: int = 2, seq: int = 33, lr: float = 1e-2,
         seed: int = 0, stages=STAGES, fsdp2: bool = True, **model_overrides) -> dict:
    """Every ZeRO stage for a few AdamW steps on a tiny Llama, against the single process.

    Run it with ``llmu.distributed.launch(demo, 2)``. Every rank builds the same model and global
    batch (``world_size * batch_per_rank`` sequences) from ``seed``, and for each stage trains a
    ZeRO copy on its shard. Returns a dict: ``num_params`` (Ψ), ``padded_params``, ``units`` (name
    and size of each flat unit), and per stage ``max_abs_error`` (per step, largest parameter
    difference from the single process trained on the whole batch), ``bit_exact`` (per step, whether
    every parameter is ``torch.equal`` to one process accumulating the ranks' micro-batches in rank
    order: :func:`~llmu.parallel.data_parallel.accumulated_steps`), ``memory`` (bytes held after
    the last step), ``peak`` (the largest during the last step), ``formula`` (the float32 formula
    for Ψ) and, in stage 3, ``events`` (the gathers and frees of the last step). With ``fsdp2``,
    ``fsdp2_vs_zero3``: the largest difference between FSDP2's parameters and ZeRO-3's after the
    last step. ``table``: :func:`memory_table` rows with the measured bytes.
    """
    reference = _tiny_model(seed, **model_overrides)
    ids = torch.randint(reference.config.vocab_size, (world_size * batch_per_rank, seq),
                        generator=torch.Generator().manual_seed(seed + 1))
    mine = ids[rank * batch_per_rank:(rank + 1) * batch_per_rank]

    _, ref_steps = single_process_steps(reference, ids, steps, lr)     # the whole batch, one process
    accumulated = accumulated_steps(_tiny_model(seed, **model_overrides), ids.chunk(world_size), steps, lr)

    result: dict = {"stages": {}}
    zero3_final = None
    for stage in stages:
        zero = ZeRO(_tiny_model(seed, **model_overrides), stage, lr=lr)
        errors, exact = [], []
        for step in range(steps):
            zero.zero_grad()
            next_token_loss(zero, mine).backward()
            zero.step()
            events = list(zero.events)              # before full_parameters' own gathers
            full = zero.full_parameters()
            errors.append(max((full[n] - ref_steps[step][n]).abs().max().item() for n in full))
            exact.append(all(torch.equal(full[n], accumulated[step][n]) for n in full))
        result["stages"][stage] = {
            "max_abs_error": errors, "bit_exact": exact, "memory": zero.memory(), "peak": dict(zero.peak),
            "formula": zero_memory_formula(zero.num_params, world_size, stage),
            "events": events if stage == 3 else None}
        result.update(num_params=zero.num_params, padded_params=zero.padded_params,
                      units=[(u.name, u.numel) for u in zero.units])
        if stage == 3:
            zero3_final = full
    if fsdp2 and zero3_final is not None:
        fsdp = fsdp2_train(_tiny_model(seed, **model_overrides), [mine] * steps, lr=lr)
        result["fsdp2_vs_zero3"] = max((fsdp[n] - zero3_final[n]).abs().max().item() for n in fsdp)
    result["table"] = memory_table(result["num_params"], world_size,
                                   measured={s: r["memory"] for s, r in result["stages"].items()})
    return result
