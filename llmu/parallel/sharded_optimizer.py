"""ZeRO stage 1 for any model and any element-wise optimizer: :class:`ShardedOptimizer`.

Plain data parallelism keeps the whole optimizer on every rank. With AdamW in float32 that is
8 bytes of state per parameter (the two moments), on top of 4 for the weight and 4 for its
gradient: ``16 Ψ`` bytes per rank for ``Ψ`` parameters, whatever the number of ranks ``W``.
Yet every rank computes the very same update. ZeRO stage 1 splits that work: rank ``r`` updates
only its ``1/W`` slice of the parameters, so it keeps the optimizer state of that slice only, and
then everyone exchanges the updated slices. Per rank::

                       weights   gradients   optimizer state        Ψ = 1e9, W = 8, AdamW fp32
    plain optimizer      4 Ψ        4 Ψ          8 Ψ          =  16 Ψ   16 GB
    ShardedOptimizer     4 Ψ        4 Ψ          8 Ψ / W      =   9 GB

Communication per step: a **reduce-scatter** of the gradients (rank ``r`` receives the sum of its
slice only) and an **all-gather** of the updated slices. A ring all-reduce *is* a reduce-scatter
followed by an all-gather, so this moves the same bytes as plain data parallelism's all-reduce:
the memory saving is free.

How the slices are laid out: the parameters of each parameter group are concatenated into one
flat buffer (``FlatGroup.flat``), padded with zeros to a multiple of ``W``; rank ``r`` owns
``flat[r S:(r + 1) S]`` with ``S = padded / W``. The parameters become views into the flat
buffer (``p.data = flat[a:b].view(p.shape)``), so the model reads and the all-gather writes the
same memory. The wrapped optimizer (``ShardedOptimizer.optimizer``, an ordinary
``optimizer_cls``) is built over the slices: one flat tensor of ``S`` elements per group. That is
the whole trick, and it is exact only for optimizers that update every element from that
element's own gradient and state (plus scalars such as the step count): SGD with momentum, Adam,
AdamW, Adagrad, RMSprop and the other element-wise optimizers of ``torch.optim``. For them the
slices give, bit for bit, the update of the whole tensors. Optimizers that look at a whole tensor
are refused: LBFGS (dot products over all the parameters), Adafactor (row and column statistics
of each matrix), Muon (orthogonalises each weight matrix) and SparseAdam (sparse gradients).

Gradients: ``step`` packs every ``p.grad`` into a flat gradient buffer of the group and then
points ``p.grad`` at its place in that buffer, so a later backward accumulates straight into it
(``zero_grad(set_to_none=False)`` keeps it that way; with ``set_to_none=True``, PyTorch's default,
the next backward allocates fresh gradients and the next step copies them in). A parameter whose
``.grad`` is ``None`` counts as a zero gradient: unlike a plain optimizer, which skips it, its
weight decay and momentum still act. Leave frozen parameters out (``requires_grad=False`` ones are
refused).

Use it inside a process group (``llmu.distributed.launch``), the same on every rank::

    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    loss_fn(model(my_shard)).backward()     # this rank's gradients
    opt.step()                              # reduce-scatter, update my slice, all-gather
    opt.zero_grad()

With ``average_gradients=False`` the gradients are taken as already averaged (by
:class:`llmu.parallel.data_parallel.DataParallel` or DDP), as ``torch.distributed.optim.
ZeroRedundancyOptimizer`` does: ``step`` then only slices, updates and all-gathers. That pair
sends 1.5 times the default's bytes per rank: the all-reduce of the whole gradient,
``2(W-1)/W · 4Ψ`` in float32, and then the all-gather, ``(W-1)/W · 4Ψ`` more, where the default's
reduce-scatter and all-gather send ``2(W-1)/W · 4Ψ`` together. What it buys is the data-parallel
wrapper's overlap of its all-reduces with the backward; the default reduces in ``step``.

:meth:`ShardedOptimizer.state_dict` is a collective that returns the state in the layout of the
plain optimizer (per parameter, full size): it loads into ``optimizer_cls(model.parameters())``,
and :meth:`ShardedOptimizer.load_state_dict` takes it back on any number of ranks.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref

import torch
import torch.distributed as dist
import torch.utils.weak

from llmu.parallel.data_parallel import require_process_group
from llmu.parallel.ordered_reduce import check_reduce_order, reduce_scatter_in_rank_order

__all__ = ["ShardedOptimizer", "FlatGroup", "ELEMENTWISE_OPTIMIZERS", "WHOLE_TENSOR_OPTIMIZERS",
           "check_optimizer_class"]

# Newer PyTorch names the single-tensor collectives *_single; older ones *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: ``torch.optim`` classes that update each element from that element alone: sharding is exact.
ELEMENTWISE_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(torch.optim, name))

#: ``torch.optim`` classes that need a whole tensor (or all of them), and why: refused.
WHOLE_TENSOR_OPTIMIZERS = {getattr(torch.optim, name): why for name, why in (
    ("LBFGS", "builds its search direction from dot products over all the parameters at once"),
    ("Adafactor", ("factors each matrix's second moment into row and column statistics, which need the "
                   "parameter's 2-D shape (a flat slice has none)")),
    ("Muon", "orthogonalises the update of each whole weight matrix"),
    ("SparseAdam", "needs sparse gradients, and the flat gradient buffer is dense"),
) if hasattr(torch.optim, name)}

# Which object flattened a parameter (a ZeRO or a ShardedOptimizer): a parameter can live in one
# flat buffer only. Weak on both sides: a parameter or owner that is gone frees its entry.
_OWNERS = torch.utils.weak.WeakIdKeyDictionary()


def _owner(p: torch.Tensor):
    ref = _OWNERS.get(p)
    return None if ref is None else ref()


def _claim(params, owner) -> None:
    """Record ``owner`` as the one object that manages ``params``; refuse parameters managed elsewhere."""
    for p in params:
        other = _owner(p)
        if other is not None and other is not owner:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is already managed by a "
                             f"{type(other).__name__}, which moved it into a flat buffer of its own: "
                             "a parameter can be sharded by one wrapper only")
    for p in params:
        _OWNERS[p] = weakref.ref(owner)


def _release(params, owner) -> None:
    for p in params:
        if _owner(p) is owner:
            del _OWNERS[p]


def check_optimizer_class(optimizer_cls, kwargs: dict | None, *, assume_elementwise: bool = False,
                          what: str = "ShardedOptimizer") -> None:
    """Refuse, before any communication, what sharding cannot run exactly.

    ``optimizer_cls`` must be a ``torch.optim.Optimizer`` subclass (``TypeError`` otherwise, an
    already-built optimizer included); one of :data:`WHOLE_TENSOR_OPTIMIZERS` is refused
    (``ValueError``); any class outside :data:`ELEMENTWISE_OPTIMIZERS` (a subclass included) is
    refused unless ``assume_elementwise=True`` says that it updates each element from that
    element alone. ``kwargs`` must be keyword arguments of its constructor (``TypeError``), and
    the constructor must accept their values (it is tried on a one-element tensor); ``None``
    checks the class only.
    """
    if not isinstance(assume_elementwise, bool):
        raise TypeError(f"assume_elementwise must be True or False, got {assume_elementwise!r}")
    if isinstance(optimizer_cls, torch.optim.Optimizer):
        raise TypeError(f"optimizer_cls must be an optimizer class such as torch.optim.AdamW, not an optimizer "
                        f"built already ({type(optimizer_cls).__name__} instance): {what} builds it over the "
                        "shards, with the keyword arguments you pass beside the class")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, "
                        f"got {optimizer_cls!r}")
    if issubclass(optimizer_cls, ShardedOptimizer):
        raise TypeError(f"optimizer_cls is {optimizer_cls.__name__}, which shards already: pass the optimizer it "
                        "would wrap (torch.optim.AdamW, ...)")
    for whole, why in WHOLE_TENSOR_OPTIMIZERS.items():
        if issubclass(optimizer_cls, whole):
            raise ValueError(f"{what} cannot shard {optimizer_cls.__name__}: it {why}. Sharding the optimizer "
                             "state is exact only for optimizers that update each element from that element "
                             f"alone, such as {', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS[:3])}")
    if optimizer_cls not in ELEMENTWISE_OPTIMIZERS and not assume_elementwise:
        raise ValueError(f"{what} knows that torch.optim's {', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)} "
                         f"update each element from that element alone, which makes sharding exact; it cannot "
                         f"tell for {optimizer_cls.__name__}. If {optimizer_cls.__name__} needs nothing but each "
                         "element's gradient and state (and scalars such as the step count), pass "
                         "assume_elementwise=True")
    if kwargs is None:
        return
    signature = inspect.signature(optimizer_cls)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    known = [name for name, p in signature.parameters.items()
             if name != "params" and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if "params" in kwargs:
        raise TypeError(f"{what} takes the parameters as its first argument, not as params=")
    unknown = sorted(set(kwargs) - set(known))
    if unknown and not takes_any:
        raise TypeError(f"{optimizer_cls.__name__} has no keyword argument {', '.join(map(repr, unknown))}; "
                        f"it takes {', '.join(known)}")
    optimizer_cls([torch.zeros(1, requires_grad=True)], **kwargs)      # its own checks of the values


def _param_groups(params) -> list[dict]:
    """``params`` as a list of group dicts with a list of tensors under ``"params"`` (PyTorch's
    forms: tensors, ``(name, tensor)`` pairs, or dicts of options with ``"params"``)."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of parameter-group dicts (such as "
                        "model.parameters()), got a single tensor")
    if isinstance(params, (set, frozenset)):
        raise TypeError("params must be an ordered iterable (a set has no fixed order, and every rank must "
                        "flatten the parameters in the same order)")
    try:
        items = list(params)
    except TypeError:
        raise TypeError(f"params must be an iterable of tensors or of parameter-group dicts, got "
                        f"{type(params).__name__}") from None
    if not items:
        raise ValueError("params is empty: ShardedOptimizer got no parameter to optimize")
    groups = items if all(isinstance(g, dict) for g in items) else [{"params": items}]
    out = []
    for g in groups:
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError("params must be all tensors or all parameter-group dicts with a 'params' key")
        group = dict(g)
        tensors = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        if tensors and all(isinstance(t, tuple) and len(t) == 2 for t in tensors):
            group["param_names"] = [name for name, _ in tensors]
            tensors = [t for _, t in tensors]
        group["params"] = tensors
        out.append(group)
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return type(a) is type(b) and a == b


@dataclasses.dataclass(eq=False)
class FlatGroup:
    """One parameter group as a flat buffer, and this rank's slice of it."""

    params: list[torch.Tensor]
    offsets: list[int]
    numel: int                      # real elements
    padded: int                     # numel rounded up to a multiple of the world size
    flat: torch.Tensor              # (padded,) every parameter of the group; the parameters are views
    shard: torch.Tensor             # flat[owned]: what the wrapped optimizer updates
    owned: slice
    grad: torch.Tensor | None = None    # (padded,) the gradients, allocated at the first step


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_cls(**kwargs)`` with its state sharded over the ranks of ``group`` (ZeRO-1).

    Build it on every rank at once, over the same parameters in the same order. Each parameter
    group becomes one flat buffer (:class:`FlatGroup`); the parameters become views into it, and
    rank 0's values are broadcast so that every replica starts equal. Then ``step()`` averages
    the gradients (a reduce-scatter; skipped with ``average_gradients=False``), lets the wrapped
    optimizer update this rank's slice, and all-gathers the slices into the parameters.

    What rank ``r`` holds: the whole parameters (``4Ψ`` bytes in float32), the whole gradients
    (``4Ψ``, in the flat gradient buffers), and the optimizer state of its slice only
    (``K Ψ / W``: 8 bytes per parameter for Adam's two moments, 4 for SGD's momentum).

    ``params``: tensors or parameter-group dicts, as for any ``torch.optim`` optimizer; each
    group's options go to the wrapped optimizer's matching group. All the tensors of a group
    need one floating dtype and one device, and ``requires_grad=True``. ``optimizer_cls``: see
    :func:`check_optimizer_class` (``assume_elementwise`` lets through an optimizer class outside
    :data:`ELEMENTWISE_OPTIMIZERS` that you know to be element-wise). ``reduce_order``:
    ``"rank"`` (default) sums the ranks' gradients in rank order, so that training is bit-identical
    to one process accumulating the same micro-batches in that order, on any number of ranks;
    ``"collective"``: the backend's reduce-scatter (:mod:`llmu.parallel.ordered_reduce`).
    ``kwargs``: the optimizer's keyword arguments.

    Attributes: ``optimizer`` (the wrapped optimizer, over the slices; its ``state`` is this
    rank's share), ``flat_groups``, ``world_size``, ``rank``. ``param_groups`` are the full
    parameters with their options (what an LR scheduler changes; ``step`` copies the options to
    the wrapped optimizer). ``zero_grad`` is PyTorch's, over the full parameters.
    """

    def __init__(self, params, optimizer_cls, *, group=None, average_gradients: bool = True,
                 assume_elementwise: bool = False, reduce_order: str = "rank", **kwargs):
        check_optimizer_class(optimizer_cls, kwargs, assume_elementwise=assume_elementwise)
        self.reduce_order = check_reduce_order(reduce_order)
        if not isinstance(average_gradients, bool):
            raise TypeError(f"average_gradients must be True or False, got {average_gradients!r}")
        groups = _param_groups(params)
        seen: set[int] = set()
        for g in groups:
            for p in g["params"]:
                self._check_param(p, seen)
            if not g["params"]:
                raise ValueError("a parameter group has no parameters")
            if len({(p.dtype, p.device) for p in g["params"]}) > 1:
                raise ValueError("the tensors of one parameter group must share one dtype and one device (they "
                                 "become one flat buffer); put the others in a group of their own, got "
                                 f"{sorted({f'{p.dtype} on {p.device}' for p in g['params']})}")
        self.world_size, self.rank = require_process_group(group, "ShardedOptimizer")
        self.group, self.optimizer_cls, self.average_gradients = group, optimizer_cls, average_gradients
        _claim([p for g in groups for p in g["params"]], self)

        # Step 1: every group becomes one flat buffer; this rank keeps a slice of it
        self.flat_groups = [self._flatten(g["params"]) for g in groups]

        # Step 2: the wrapped optimizer sees the slices only, with each group's own options
        options = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in groups]
        self.optimizer = optimizer_cls([{"params": [fg.shard], **opts} for fg, opts in zip(self.flat_groups, options)],
                                       **kwargs)

        # Step 3: the full parameters, with the wrapped optimizer's options, are this object's groups
        self._initialising = True
        super().__init__(groups, dict(self.optimizer.defaults))
        self._initialising = False

    # -- construction -----------------------------------------------------------------------------
    @staticmethod
    def _check_param(p, seen: set[int]) -> None:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"ShardedOptimizer optimizes tensors; got a {type(p).__name__}")
        if not p.is_floating_point():
            raise TypeError(f"ShardedOptimizer optimizes floating-point tensors; got one of dtype {p.dtype}")
        if not p.requires_grad:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} has requires_grad=False: a frozen parameter "
                             "would still be stepped (its missing gradient counts as zero, so weight decay and "
                             "momentum act); leave it out, e.g. [p for p in model.parameters() if p.requires_grad]")
        if not p.is_leaf:
            raise ValueError("ShardedOptimizer cannot optimize a non-leaf tensor")
        if id(p) in seen:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is given twice (a tied weight listed twice, "
                             "or in two groups): list every parameter once")
        seen.add(id(p))

    def _flatten(self, params: list[torch.Tensor]) -> FlatGroup:
        offsets, numel = [], 0
        for p in params:
            offsets.append(numel)
            numel += p.numel()
        padded = -(-numel // self.world_size) * self.world_size
        flat = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for p, off in zip(params, offsets):
                flat[off:off + p.numel()].copy_(p.reshape(-1))
            dist.broadcast(flat, src=0 if self.group is None else dist.get_global_rank(self.group, 0),
                           group=self.group)
        for p, off in zip(params, offsets):
            p.data = flat[off:off + p.numel()].view(p.shape)        # the model now reads the flat buffer
        size = padded // self.world_size
        owned = slice(self.rank * size, (self.rank + 1) * size)
        return FlatGroup(list(params), offsets, numel, padded, flat, flat[owned], owned)

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_initialising", False):
            raise NotImplementedError("ShardedOptimizer cannot add a parameter group after construction: every "
                                      "rank would have to flatten it at once; build a new ShardedOptimizer")
        super().add_param_group(param_group)

    # -- the step ---------------------------------------------------------------------------------
    def _sync_options(self) -> None:
        """Copy each group's options (an LR scheduler may have changed ``lr``) to the wrapped optimizer."""
        for mine, inner in zip(self.param_groups, self.optimizer.param_groups):
            for key, value in mine.items():
                if key not in ("params", "param_names"):
                    inner[key] = value

    @torch.no_grad()
    def _gather_gradient(self, fg: FlatGroup) -> None:
        """Pack the gradients into ``fg.grad`` (``None`` counts as zero), point every ``p.grad`` at
        its place there, and give this rank's slice its gradient: the average over the ranks
        (reduce-scatter, then ``/ W``), or the slice as it is with ``average_gradients=False``."""
        if fg.grad is None:
            fg.grad = torch.zeros_like(fg.flat)
        for p, off in zip(fg.params, fg.offsets):
            slot = fg.grad[off:off + p.numel()].view(p.shape)
            if p.grad is None:
                slot.zero_()
            elif p.grad.data_ptr() != slot.data_ptr() or p.grad.shape != slot.shape:
                slot.copy_(p.grad)
            p.grad = slot
        if self.average_gradients:
            mine = torch.empty_like(fg.shard)
            if self.reduce_order == "rank":         # g0 + g1 + ... in rank order: exact
                reduce_scatter_in_rank_order(mine, fg.grad, self.group)
            else:
                _reduce_scatter(mine, fg.grad, group=self.group)
            fg.shard.grad = mine.div_(self.world_size)
        else:
            fg.shard.grad = fg.grad[fg.owned].clone()

    @torch.no_grad()
    def step(self, closure=None):
        """Average the gradients, update this rank's slice, all-gather the new parameters.

        A collective: every rank calls it. ``closure`` (re-evaluates the loss) is called first,
        with gradients enabled, and its value returned.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_options()
        for fg in self.flat_groups:
            self._gather_gradient(fg)
        self.optimizer.step()
        for fg in self.flat_groups:
            fg.shard.grad = None
            _all_gather(fg.flat, fg.shard.clone(), group=self.group)     # the input may not alias the output
        return loss

    # -- state, in the plain optimizer's layout ---------------------------------------------------
    @torch.no_grad()
    def state_dict(self) -> dict:
        """The state as ``optimizer_cls(params).state_dict()`` would give it: per parameter, full
        size, parameters numbered in order across the groups. A collective (each per-element
        state tensor is all-gathered): every rank must call it, and every rank gets the same dict.
        """
        self._sync_options()
        state, groups, index = {}, [], 0
        for fg, options in zip(self.flat_groups, self.param_groups):
            full, per_element = {}, set()
            for key, value in self.optimizer.state.get(fg.shard, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == fg.shard.shape:     # one entry per element
                    full[key] = value.new_empty(fg.padded)
                    _all_gather(full[key], value.contiguous(), group=self.group)
                    per_element.add(key)
                else:                                                                   # the step count
                    full[key] = value
            ids = []
            for p, off in zip(fg.params, fg.offsets):
                if full:
                    state[index] = {key: value[off:off + p.numel()].view(p.shape).clone() if key in per_element
                                    else value.clone() if isinstance(value, torch.Tensor) else value
                                    for key, value in full.items()}
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in options.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state in the plain optimizer's layout (from :meth:`state_dict`, or from a plain
        ``optimizer_cls`` over the same parameters in the same order): each rank keeps its slice.
        Not a collective. Tensors of a parameter's shape are per-element state (sliced); anything
        else (the step count) must be the same for every parameter of a group."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise TypeError("state_dict must be a dict with 'state' and 'param_groups', as state_dict() returns")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.flat_groups) or any(len(g["params"]) != len(fg.params)
                                                       for g, fg in zip(groups, self.flat_groups)):
            raise ValueError(f"state_dict has groups of {[len(g['params']) for g in groups]} parameters; this "
                             f"optimizer has {[len(fg.params) for fg in self.flat_groups]}")
        new_states = []
        for g, fg in zip(groups, self.flat_groups):
            states = [state_dict["state"].get(i, state_dict["state"].get(str(i), {})) for i in g["params"]]
            if not any(states):
                new_states.append({})
                continue
            keys = set(states[0])
            if not all(states) or any(set(s) != keys for s in states):
                raise ValueError("the parameters of a group must all have the same state keys (the sharded "
                                 "optimizer steps a group as one tensor); some have none or others")
            shard_state = {}
            for key in sorted(keys):
                values = [s[key] for s in states]
                if all(isinstance(v, torch.Tensor) and v.shape == p.shape and p.dim() > 0
                       for v, p in zip(values, fg.params)):
                    flat = torch.cat([v.reshape(-1).to(fg.flat) for v in values])
                    flat = torch.cat([flat, flat.new_zeros(fg.padded - fg.numel)])
                    shard_state[key] = flat[fg.owned].clone()
                elif any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
                    raise ValueError(f"state {key!r} has tensors that are not of their parameter's shape (or a "
                                     "0-d parameter has per-element state): ShardedOptimizer cannot slice it")
                else:
                    first = values[0]
                    if not all(_same(v, first) for v in values):
                        raise ValueError(f"state {key!r} differs between the parameters of a group; the sharded "
                                         "optimizer keeps one value per group")
                    shard_state[key] = first.clone() if isinstance(first, torch.Tensor) else first
            new_states.append(shard_state)
        for g, fg, mine, shard_state in zip(groups, self.flat_groups, self.param_groups, new_states):
            mine.update({k: v for k, v in g.items() if k not in ("params", "param_names")})
            self.optimizer.state.pop(fg.shard, None)
            if shard_state:
                self.optimizer.state[fg.shard] = shard_state
        self._sync_options()

    # -- measuring --------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (every tensor of the wrapped optimizer's state)."""
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{fg.numel} (padded {fg.padded}, this rank's slice {fg.shard.numel()})"
                          for fg in self.flat_groups)
        return (f"ShardedOptimizer({self.optimizer_cls.__name__}, world_size={self.world_size}, rank={self.rank}, "
                f"groups: {sizes})")

