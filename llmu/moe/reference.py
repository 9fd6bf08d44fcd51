"""Mixture-of-Experts in PyTorch: routing, capacity, auxiliary losses, and the loop-over-experts layer.

An MoE feed-forward replaces one SwiGLU MLP with ``E`` of them (the *experts*) and a *router*, a
linear map ``W_r`` of shape ``(E, H)``. For each token ``x_t``:

.. math::

    p_t = \\operatorname{softmax}(W_r x_t) \\in \\mathbb{R}^E, \\qquad
    S_t = \\operatorname{top\\text{-}k}(p_t), \\qquad
    y_t = \\sum_{e \\in S_t} g_{t,e}\\, \\operatorname{MLP}_e(x_t),

with gate weights ``g_{t,e} = p_{t,e}`` (Switch Transformer, ``k = 1``) or
``g_{t,e} = p_{t,e} / \\sum_{e' \\in S_t} p_{t,e'}`` (*renormalised*, as in Mixtral, ``k = 2``).
Each token pays for ``k`` MLPs while the layer holds ``E`` of them: parameters grow with ``E``,
FLOPs per token with ``k``.

Three training-time additions, all here:

- **capacity** (:func:`expert_capacity`, :func:`dispatch_mask`): with a fixed buffer of
  ``C = ceil(capacity_factor * T * k / E)`` slots per expert, the assignments an expert receives
  beyond ``C`` are *dropped* (their contribution is 0; the residual connection around the layer
  carries the token on);
- **load balancing** (:func:`load_balancing_loss`): pushes the router to spread tokens evenly;
- **router z-loss** (:func:`router_z_loss`): keeps the router's logits small.

:func:`moe_reference` is the specification the Triton path (``llmu.moe.kernels``) is tested
against: it loops over the experts, gathers each one's tokens, runs its MLP and scatter-adds the
weighted outputs. ``llmu.moe.layer.MoEFeedForward`` wraps it (or the Triton path) as an ``nn.Module``.

Weight layout: ``nn.Linear``'s ``(out, in)`` per expert, stacked along a leading expert axis:
``w_gate``, ``w_up`` are ``(E, F, H)`` and ``w_down`` is ``(E, H, F)``, so ``w_gate[e]`` is exactly
what ``llmu.layers.reference.swiglu`` takes as ``w_gate``.

What the layer functions accept (:func:`moe_reference`, ``kernels.moe_triton``,
:func:`check_moe_inputs`; :func:`route` for the router):

- the router as its weight ``router_weight`` ``(E, H)`` (the logits are then ``x @ router_weight^T``,
  computed in float32), **or** as logits already computed, ``router_logits=`` ``(..., E)`` with
  ``x``'s leading shape (or flattened, ``(T, E)``), any floating dtype (softmax and top-k run in
  float32 at least). Exactly one of the two. The logits are used as given, so the gradient of the
  gate weights and of the losses flows into them (and from there into whatever computed them);
- the experts' gate and up projections as ``w_gate`` and ``w_up`` ``(E, F, H)``, **or** as one fused
  ``w_gate_up=`` ``(E, 2F, H)``: for each expert the ``F`` gate rows first, then the ``F`` up rows,
  i.e. ``w_gate_up = torch.cat([w_gate, w_up], dim=1)`` (:func:`split_gate_up` gives the two halves
  back as views). This is the layout of ``gate_up_proj`` in transformers' (5.x) Mixtral and
  Qwen2-MoE/Qwen3-MoE experts, which also stack ``down_proj`` as ``(E, H, F)`` and call the router
  ``gate.weight`` ``(E, H)``: those three tensors go in as they are. GPT-OSS differs: its
  ``gate_up_proj`` is ``(E, H, 2F)`` (``x @ W``, no transpose) with gate and up *interleaved* along
  the last axis (gate in the even columns, up in the odd ones), its ``down_proj`` is ``(E, F, H)``,
  and its experts add biases and use a clamped activation other than SwiGLU; its weights would need
  ``torch.cat([W[..., ::2], W[..., 1::2]], dim=-1).transpose(1, 2)`` (and ``down_proj.transpose(1, 2)``)
  and would still not compute GPT-OSS's function.

Positional calls keep their meaning: ``moe_reference(x, router_weight, w_gate, w_up, w_down, k)``.
The alternatives are keywords, e.g. ``moe_reference(x, router_logits=lg, w_gate_up=wgu, w_down=wd, k=2)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmu.checks import require_positive
from llmu.layers.reference import swiglu

__all__ = [
    "router_probs", "top_k_route", "expert_capacity", "expert_positions", "dispatch_mask",
    "load_balancing_loss", "router_z_loss", "MoEAux", "route", "moe_reference", "check_moe_inputs",
    "split_gate_up",
]


# ----------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 at least (float64 stays float64, for gradient checks)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def router_probs(logits: torch.Tensor) -> torch.Tensor:
    """``softmax(logits)`` over the last (expert) dimension, in float32 (softmax in bf16 would
    round probabilities that decide which experts win; float64 stays float64)."""
    return torch.softmax(_wide(logits), dim=-1)


def top_k_route(logits: torch.Tensor, k: int, *, renormalize: bool = True):
    """Softmax gating with top-``k`` selection.

    ``logits``: ``(T, E)``. Returns ``(weights, experts, probs)``:

    - ``probs`` ``(T, E)`` float32: ``softmax(logits)``;
    - ``experts`` ``(T, k)`` int64: the ``k`` most probable experts of each token, most probable
      first (ties in ``torch.topk``'s order);
    - ``weights`` ``(T, k)`` float32: their probabilities ``p_{t,e}``, divided by their sum when
      ``renormalize`` (Mixtral; the ``k`` weights then sum to 1), raw otherwise (Switch, ``k = 1``:
      the weight is ``p_{t,e} < 1``, which is how the router's gradient reaches its logits).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be (T, E), got shape {tuple(logits.shape)}")
    num_experts = logits.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k must be an int with 1 <= k <= E (the number of experts); got k={k!r}, E={num_experts}")
    probs = router_probs(logits)
    weights, experts = probs.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts, probs


# ----------------------------------------------------------------------------------------------
# Capacity and dropping
# ----------------------------------------------------------------------------------------------


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert: ``C = ceil(capacity_factor * T * k / E)``.

    ``T * k / E`` is what each expert receives under perfect balance; ``capacity_factor`` (1.0 to
    2.0 in Switch/GShard) is the headroom for imbalance. A tiny tolerance (1e-9 of a slot) keeps
    float rounding from adding a slot, e.g. ``1.1 * 10 = 11.000000000000002`` gives 11, not 12.
    Raises ``ValueError`` ("capacity below one token") when the factor leaves no slot, which with
    the ceiling means ``capacity_factor <= 0`` or ``num_tokens == 0``.
    """
    require_positive("num_experts", num_experts, integer=True)
    require_positive("k", k, integer=True)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
            or not math.isfinite(capacity_factor):
        raise ValueError(f"capacity_factor must be a finite number, got {capacity_factor!r}")
    ideal = capacity_factor * num_tokens * k / num_experts
    capacity = math.ceil(ideal - 1e-9) if ideal > 0 else 0
    if capacity < 1:
        raise ValueError(f"capacity below one token: capacity_factor={capacity_factor!r} with T={num_tokens}, "
                         f"k={k}, E={num_experts} gives ceil({ideal:g}) = {capacity} slots per expert")
    return capacity


def expert_positions(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``(T, k)`` int64: the arrival rank of each assignment at its expert (0 = first).

    Assignments arrive in *token order*: ``(t, j)`` before ``(t', j')`` when ``t < t'`` (a
    token's ``k`` experts are distinct, so ``j`` never breaks a tie). This is the order of the
    flattened ``(T, k)`` tensor, and a running count (``cumsum`` of one-hot rows) gives the rank.
    """
    flat = experts.reshape(-1)
    one_hot = F.one_hot(flat, num_experts)                     # (T*k, E)
    rank = one_hot.cumsum(dim=0).gather(1, flat[:, None]) - 1  # arrivals so far at my expert, minus me
    return rank.view(experts.shape)


def dispatch_mask(experts: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """``(T, k)`` bool: which assignments are kept when each expert holds ``capacity`` slots.

    An expert takes its assignments in token order (position priority, as in Switch Transformer
    and GShard) until its ``capacity`` slots are full; the later ones are dropped. So the earlier
    tokens of a sequence always get through and the last ones are the first to lose an expert.
    ``capacity=None``: no limit, everything is kept. (GShard's top-2 gives every first choice
    priority over every second choice; here a token's choices share its place in the queue,
    which is the same thing for ``k = 1``.)
    """
    if capacity is None:
        return torch.ones(experts.shape, dtype=torch.bool, device=experts.device)
    return expert_positions(experts, num_experts) < capacity


# ----------------------------------------------------------------------------------------------
# Auxiliary losses
# ----------------------------------------------------------------------------------------------


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int,
                        alpha: float = 0.01) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6), generalised to top-k.

    .. math::

        L_{\\text{bal}} = \\alpha\\, E \\sum_{i=1}^{E} f_i\\, P_i, \\qquad
        f_i = \\frac{1}{T k} \\sum_{t, j} [\\text{expert}_{t,j} = i], \\qquad
        P_i = \\frac{1}{T} \\sum_t p_{t,i}.

    Convention: ``f`` counts each of the ``k`` choices of a token (so ``sum(f) = 1`` for every
    ``k``), *before* capacity dropping. ``f`` comes from an ``argmax``/``topk`` and carries no
    gradient; ``P`` does, and the gradient lowers the probability of the experts that receive
    the most tokens. Under perfect balance (``f_i = P_i = 1/E``) the loss is exactly ``alpha``;
    when every token goes to one expert with probability near 1 it approaches ``alpha * E``.
    ``probs``: ``(T, E)``; ``experts``: ``(T, k)``. Returns a scalar (float32, or float64 for float64 ``probs``).
    """
    if probs.ndim != 2 or probs.shape[-1] != num_experts:
        raise ValueError(f"probs must be (T, E={num_experts}), got shape {tuple(probs.shape)}")
    if experts.ndim != 2 or experts.shape[0] != probs.shape[0]:
        raise ValueError(f"experts must be (T={probs.shape[0]}, k), got shape {tuple(experts.shape)}")
    if probs.shape[0] == 0:  # no tokens: nothing to balance (and a mean over nothing would be nan)
        return _wide(probs).sum() * 0.0
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).to(_wide(probs).dtype)
    f = counts / max(experts.numel(), 1)
    P = _wide(probs).mean(dim=0)
    return alpha * num_experts * (f * P).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022): ``mean_t (logsumexp_i logits_{t,i})^2``.

    Softmax ignores a constant added to all logits, so nothing else stops them from drifting
    large, where bf16 rounds them coarsely and the exponentials overflow. Penalising the squared
    log-partition keeps them near zero. (ST-MoE weighs it by 1e-3 in the total loss.)
    """
    lse = torch.logsumexp(_wide(logits), dim=-1)
    return lse.pow(2).mean() if lse.numel() else lse.sum()   # no tokens: 0, not nan


# ----------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------


@dataclass
class MoEAux:
    """What one MoE forward decided, for the losses and for plots.

    ``logits`` ``(T, E)`` and ``probs`` ``(T, E)``: the router's; ``experts`` ``(T, k)`` int64 and
    ``weights`` ``(T, k)``: the top-k choices and their gate weights (not zeroed for dropped
    ones); ``tokens_per_expert`` ``(E,)`` int64: assignments routed to each expert *before*
    dropping (the router's demand); ``dropped`` ``(T, k)`` bool: assignments over capacity (all
    False without a capacity); ``capacity``: slots per expert or None; ``lb_loss`` (with
    ``alpha = 0.01``) and ``z_loss``: differentiable scalars. Floating tensors are float32
    (float64 for float64 inputs).
    """

    logits: torch.Tensor
    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor
    capacity: int | None
    lb_loss: torch.Tensor
    z_loss: torch.Tensor

    @property
    def kept(self) -> torch.Tensor:
        """``(T, k)`` bool: the assignments that were computed."""
        return ~self.dropped

    @property
    def num_dropped(self) -> int:
        return int(self.dropped.sum())


def split_gate_up(w_gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_gate, w_up)``, each ``(E, F, H)``: the two halves of a fused ``w_gate_up`` ``(E, 2F, H)``.

    Rows ``[0, F)`` of each expert are its gate projection, rows ``[F, 2F)`` its up projection
    (``w_gate_up == torch.cat([w_gate, w_up], dim=1)``). Views, no copy: a gradient through them
    lands in ``w_gate_up``. Raises ``ValueError`` naming ``w_gate_up`` for a shape that is not
    ``(E, 2F, H)`` with an even ``2F``.
    """
    if not isinstance(w_gate_up, torch.Tensor):
        raise TypeError(f"w_gate_up must be a torch.Tensor, got {type(w_gate_up).__name__}")
    if w_gate_up.ndim != 3:
        raise ValueError(f"w_gate_up must be (E, 2F, H), got shape {tuple(w_gate_up.shape)}")
    if w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must have an even number of rows per expert (F gate rows, then F up rows), "
                         f"got 2F={w_gate_up.shape[1]} in shape {tuple(w_gate_up.shape)}")
    ffn = w_gate_up.shape[1] // 2
    return w_gate_up[:, :ffn], w_gate_up[:, ffn:]


def _check_router_logits(router_logits, x: torch.Tensor) -> int:
    """Check ``router_logits`` against ``x`` ``(..., H)``; return ``E``."""
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
    if not router_logits.is_floating_point():
        raise TypeError(f"router_logits must have a floating-point dtype, got {router_logits.dtype}")
    lead = tuple(x.shape[:-1])
    num_tokens = math.prod(lead)
    shape = tuple(router_logits.shape)
    if router_logits.ndim < 1 or not (shape[:-1] == lead or (router_logits.ndim == 2 and shape[0] == num_tokens)):
        raise ValueError(f"router_logits must be (..., E) with x's leading shape {lead} (or flattened, "
                         f"(T={num_tokens}, E)), got shape {shape}")
    if shape[-1] < 1:
        raise ValueError("router_logits must have at least one expert (its last dimension is 0)")
    if router_logits.device != x.device:
        raise ValueError(f"router_logits is on {router_logits.device} but x is on {x.device}; they must match")
    return shape[-1]


def _exactly_one_router(router_weight, router_logits) -> None:
    if router_weight is None and router_logits is None:
        raise TypeError("the router is missing: pass router_weight (E, H) or router_logits (..., E)")
    if router_weight is not None and router_logits is not None:
        raise TypeError("router_weight and router_logits exclude each other (the logits are x @ router_weight^T): "
                        "pass one of them, not both")


def check_moe_inputs(x, router_weight=None, w_gate=None, w_up=None, w_down=None, k=None, *, world_size: int = 1,
                     router_logits=None, w_gate_up=None) -> tuple[int, int, int]:
    """Shapes of an MoE call; returns ``(E, H, F)`` or raises naming the argument.

    The router is ``router_weight`` ``(E, H)`` or ``router_logits`` ``(..., E)`` (``x``'s leading
    shape, or ``(T, E)``; floating point; on ``x``'s device): exactly one of them. The gate and up
    projections are ``w_gate`` and ``w_up`` ``(E, F, H)``, or ``w_gate_up`` ``(E, 2F, H)`` (gate
    rows first, then up rows; same dtype as ``w_down``) instead of both. ``ValueError`` for a wrong
    shape or value, ``TypeError`` for a wrong type or dtype and for a missing, doubled or
    conflicting argument (as Python does for its own arguments).

    The router covers all ``E`` experts. With ``world_size`` ``W > 1`` (expert parallelism,
    ``llmu.moe.expert_parallel``) the expert weights are one rank's slice of ``E / W`` experts;
    otherwise all ``E``.
    """
    _exactly_one_router(router_weight, router_logits)
    if w_gate_up is not None and (w_gate is not None or w_up is not None):
        given = " and ".join(n for n, t in (("w_gate", w_gate), ("w_up", w_up)) if t is not None)
        raise TypeError(f"w_gate_up replaces w_gate and w_up: pass w_gate_up alone, or w_gate and w_up; "
                        f"got w_gate_up and {given}")
    if w_gate_up is None and (w_gate is None or w_up is None):
        missing = " and ".join(n for n, t in (("w_gate", w_gate), ("w_up", w_up)) if t is None)
        raise TypeError(f"{missing} missing: pass w_gate and w_up (E, F, H), or the fused w_gate_up (E, 2F, H)")
    if w_down is None:
        raise TypeError("w_down is missing: pass the experts' down projections (E, H, F)")
    if k is None:
        raise TypeError("k is missing: pass the number of experts per token")
    for name, t in (("x", x), ("router_weight", router_weight), ("w_gate", w_gate), ("w_up", w_up),
                    ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.ndim < 1:
        raise ValueError("x must be (..., H), got a scalar")
    hidden = x.shape[-1]
    if router_weight is not None:
        if router_weight.ndim != 2 or router_weight.shape[1] != hidden:
            raise ValueError(f"router_weight must be (E, H={hidden}), got shape {tuple(router_weight.shape)}")
        num_experts = router_weight.shape[0]
        if num_experts < 1:
            raise ValueError("router_weight must have at least one expert (row)")
    else:
        num_experts = _check_router_logits(router_logits, x)
    router = "router_weight" if router_logits is None else "router_logits"
    require_positive("world_size", world_size, integer=True)
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by world_size={world_size}: "
                         f"every rank must hold the same number of experts (E from {router})")
    held = num_experts // world_size
    experts = f"E={held}" if world_size == 1 else f"E/W={held}"        # all, or this rank's slice
    if w_gate_up is not None:
        if w_gate_up.ndim != 3 or w_gate_up.shape[0] != held or w_gate_up.shape[2] != hidden:
            raise ValueError(f"w_gate_up must be ({experts}, 2F, H={hidden}) (E from {router}), "
                             f"got shape {tuple(w_gate_up.shape)}")
        ffn = split_gate_up(w_gate_up)[0].shape[1]          # refuses an odd 2F
        if not w_gate_up.is_floating_point():
            raise TypeError(f"w_gate_up must have a floating-point dtype, got {w_gate_up.dtype}")
        if w_gate_up.dtype != w_down.dtype:
            raise TypeError(f"w_gate_up has dtype {w_gate_up.dtype} but w_down has {w_down.dtype}; they must match")
    else:
        if w_gate.ndim != 3 or w_gate.shape[0] != held or w_gate.shape[2] != hidden:
            raise ValueError(f"w_gate must be ({experts}, F, H={hidden}), got shape {tuple(w_gate.shape)}")
        ffn = w_gate.shape[1]
        if w_up.shape != w_gate.shape:
            raise ValueError(f"w_up must have w_gate's shape {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
    if w_down.shape != (held, hidden, ffn):
        raise ValueError(f"w_down must be ({experts}, H={hidden}, F={ffn}), got shape {tuple(w_down.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k must be an int with 1 <= k <= E (the number of experts); got k={k!r}, E={num_experts}")
    return num_experts, hidden, ffn


def route(x2: torch.Tensor | None = None, router_weight: torch.Tensor | None = None, k: int | None = None, *,
          router_logits: torch.Tensor | None = None, renormalize: bool = True,
          capacity_factor: float | None = None, alpha: float = 0.01, select=None) -> MoEAux:
    """The router half of an MoE layer on ``x2`` ``(T, H)``: logits (float32), top-k, capacity,
    losses. Shared by :func:`moe_reference` and the Triton path, so both take the same decisions.

    The logits are ``x2 @ router_weight^T`` (``router_weight`` ``(E, H)``), or ``router_logits``
    ``(..., E)`` as given (flattened to ``(T, E)`` and widened to float32 at least; ``x2`` may then
    be ``None``, and otherwise must have ``T`` rows). Exactly one of ``router_weight`` and
    ``router_logits``. Gradients reach ``router_logits`` through the gate weights and both losses.

    ``select``: another rule for the top-k choice, ``select(logits (T, E)) -> (weights, experts)``
    (each ``(T, k)``), in place of :func:`top_k_route`'s (``llmu.moe.balance.BiasBalancer``
    chooses with a per-expert bias); the probabilities and losses are the same either way.
    """
    _exactly_one_router(router_weight, router_logits)
    if k is None:
        raise TypeError("k is missing: pass the number of experts per token")
    if router_logits is None:
        if x2 is None:
            raise TypeError("x2 is missing: router_weight needs the tokens x2 (T, H) to compute the logits")
        logits = _wide(x2) @ _wide(router_weight).T
    else:
        if not isinstance(router_logits, torch.Tensor):
            raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
        if not router_logits.is_floating_point():
            raise TypeError(f"router_logits must have a floating-point dtype, got {router_logits.dtype}")
        if router_logits.ndim < 1:
            raise ValueError("router_logits must be (..., E), got a scalar")
        logits = _wide(router_logits).reshape(-1, router_logits.shape[-1])
        if x2 is not None and logits.shape[0] != x2.shape[0]:
            raise ValueError(f"router_logits must hold one row per token of x2 (T={x2.shape[0]}), "
                             f"got shape {tuple(router_logits.shape)}")
    num_experts, num_tokens = logits.shape[-1], logits.shape[0]
    weights, experts, probs = top_k_route(logits, k, renormalize=renormalize)
    if select is not None:
        weights, experts = _checked_selection(select(logits), num_tokens, k, num_experts)
    capacity = None
    if capacity_factor is not None and num_tokens > 0:
        capacity = expert_capacity(num_tokens, num_experts, k, capacity_factor)
    elif capacity_factor is not None:
        expert_capacity(1, num_experts, k, capacity_factor)  # still refuse a factor that gives no slot
    kept = dispatch_mask(experts, num_experts, capacity)
    return MoEAux(
        logits=logits, probs=probs, experts=experts, weights=weights,
        tokens_per_expert=torch.bincount(experts.reshape(-1), minlength=num_experts),
        dropped=~kept, capacity=capacity,
        lb_loss=load_balancing_loss(probs, experts, num_experts, alpha),
        z_loss=router_z_loss(logits),
    )


def _checked_selection(chosen, num_tokens: int, k: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a ``select`` rule returned, checked: ``(weights, experts)``, each ``(T, k)``, experts
    int64 in ``[0, E)`` and different within a token."""
    if not (isinstance(chosen, (tuple, list)) and len(chosen) == 2
            and all(isinstance(t, torch.Tensor) for t in chosen)):
        raise TypeError("select must return (weights, experts), two tensors of shape (T, k)")
    weights, experts = chosen
    for name, t in (("weights", weights), ("experts", experts)):
        if tuple(t.shape) != (num_tokens, k):
            raise ValueError(f"select returned {name} of shape {tuple(t.shape)}, expected (T, k) = ({num_tokens}, {k})")
    if experts.dtype != torch.int64:
        raise TypeError(f"select returned experts of dtype {experts.dtype}, expected torch.int64")
    if num_tokens and (experts.min() < 0 or experts.max() >= num_experts):
        raise ValueError(f"select returned experts outside [0, E = {num_experts})")
    if k > 1 and num_tokens and (experts.sort(dim=-1).values.diff(dim=-1) == 0).any():
        raise ValueError("select returned the same expert twice for one token")
    return weights, experts


def moe_reference(x, router_weight=None, w_gate=None, w_up=None, w_down=None, k: int | None = None, *,
                  router_logits=None, w_gate_up=None, renormalize: bool = True,
                  capacity_factor: float | None = None, select=None):
    """The MoE feed-forward, one expert at a time: ``(y, aux)``.

    ``x``: ``(..., H)``; ``router_weight``: ``(E, H)``; ``w_gate``, ``w_up``: ``(E, F, H)``;
    ``w_down``: ``(E, H, F)``. ``y`` has ``x``'s shape and dtype; ``aux`` is a :class:`MoEAux`.
    Instead of ``router_weight``, ``router_logits=`` ``(..., E)`` (``x``'s leading shape, or
    ``(T, E)``); instead of ``w_gate`` and ``w_up``, ``w_gate_up=`` ``(E, 2F, H)``, gate rows
    first (``torch.cat([w_gate, w_up], dim=1)``; the module docstring relates it to transformers'
    ``gate_up_proj``). The fused weight is read through two views (:func:`split_gate_up`), so the
    result is the one of the separate weights, to the bit. ``select``: another top-k rule (see
    :func:`route`). Arguments are checked by :func:`check_moe_inputs`.

    For each expert ``e``: find the kept assignments ``(t, j)`` with ``experts[t, j] == e``,
    gather those rows of ``x``, run module 03's ``swiglu`` on them, and add
    ``weights[t, j] * out`` into row ``t`` of ``y`` (accumulated in float32; float64 inputs in
    float64). A dropped assignment adds nothing; the other choice of the same token keeps its
    weight (no re-normalisation after dropping). Differentiable in ``x``, every weight and the
    router (``router_weight`` or ``router_logits``).
    """
    num_experts, _, _ = check_moe_inputs(x, router_weight, w_gate, w_up, w_down, k,
                                         router_logits=router_logits, w_gate_up=w_gate_up)
    if w_gate_up is not None:
        w_gate, w_up = split_gate_up(w_gate_up)
    x2 = x.reshape(-1, x.shape[-1])
    aux = route(x2, router_weight, k, router_logits=router_logits, renormalize=renormalize,
                capacity_factor=capacity_factor, select=select)
    kept = ~aux.dropped
    y = torch.zeros(x2.shape, dtype=_wide(x2).dtype, device=x.device)
    for e in range(num_experts):
        # Step 1: which (token, choice) pairs go to expert e
        tok, slot = torch.nonzero((aux.experts == e) & kept, as_tuple=True)
        if tok.numel() == 0:
            continue
        # Step 2: gather their rows and run the expert's SwiGLU MLP
        out = swiglu(x2[tok], w_gate[e], w_up[e], w_down[e])
        # Step 3: scatter-add the gate-weighted outputs back to their tokens
        y = y.index_add(0, tok, out.to(y.dtype) * aux.weights[tok, slot, None].to(y.dtype))
    return y.to(x.dtype).view(x.shape), aux
