"""The MoE feed-forward as an ``nn.Module``: one layer, two implementations.

:class:`MoEFeedForward` holds a router and ``E`` SwiGLU experts and runs either the loop over
experts of ``llmu.moe.reference`` (``moe_reference``) or the Triton path of ``llmu.moe.kernels``
(``moe_triton``: permute, grouped GEMMs, unpermute). Both return the same ``(y, aux)``.

The layer lives in a module of its own because it needs both: the kernels are checked against
the reference, so ``kernels`` imports ``reference``, and neither of them imports this module.
``kernels`` is imported on the first Triton forward only, so a layer that runs on its torch path
never imports Triton.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from llmu import runtime
from llmu.checks import require_positive
from llmu.moe.reference import MoEAux, expert_capacity, moe_reference, split_gate_up

__all__ = ["MoEFeedForward", "IMPLS"]

#: The values ``MoEFeedForward(impl=...)`` accepts (``None`` picks one, see the class).
IMPLS = ("torch", "triton")


class MoEFeedForward(nn.Module):
    """An MoE SwiGLU feed-forward: a router and ``num_experts`` experts of width ``intermediate``.

    Parameters: ``router`` (``nn.Linear(hidden, num_experts, bias=False)``), ``w_gate``,
    ``w_up`` ``(E, F, H)`` and ``w_down`` ``(E, H, F)``, initialised like ``nn.Linear``
    (uniform in ``±1/sqrt(fan_in)``). ``forward(x)`` takes ``(..., hidden)``, returns the same
    shape and keeps the routing decisions and losses in ``self.last_aux`` (a :class:`MoEAux`;
    add ``last_aux.lb_loss`` and ``last_aux.z_loss`` to the training loss).

    ``fused_gate_up=True`` holds one ``w_gate_up`` ``(E, 2F, H)`` (gate rows, then up rows) in
    place of ``w_gate`` and ``w_up``: the layout of ``experts.gate_up_proj`` in transformers'
    Mixtral and Qwen-MoE models (with ``experts.down_proj`` as ``w_down`` and ``gate.weight`` as
    ``router.weight``), and on the Triton path one grouped GEMM for both projections.
    :meth:`gate_up` gives ``(w_gate, w_up)`` in either layout (views of ``w_gate_up`` when fused).

    ``impl``: ``"torch"`` (:func:`moe_reference`), ``"triton"`` (``llmu.moe.kernels.moe_triton``:
    permute, grouped GEMMs, unpermute), or ``None``: Triton when kernels are compiled on a GPU and
    the input is there, torch otherwise (on CPU the interpreter runs every program in numpy: slow).
    Both paths are differentiable and take the same routing decisions.

    ``select``: None (top-k of the probabilities), or another top-k rule, a callable
    ``select(logits (T, E)) -> (weights, experts)``; ``llmu.moe.train.train(balancer=...)`` sets
    it to choose experts with a per-expert bias (auxiliary-loss-free balancing, ``llmu.moe.balance``).
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, k: int, renormalize: bool = True,
                 capacity_factor: float | None = None, impl: str | None = None, dtype=None, device=None,
                 fused_gate_up: bool = False):
        super().__init__()
        require_positive("hidden", hidden, integer=True)
        require_positive("intermediate", intermediate, integer=True)
        require_positive("num_experts", num_experts, integer=True)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
            raise ValueError(f"k must be an int with 1 <= k <= E (the number of experts); got k={k!r}, E={num_experts}")
        if impl is not None and impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
        if capacity_factor is not None:
            expert_capacity(1, num_experts, k, capacity_factor)  # refuse a factor that gives no slot now
        if not isinstance(fused_gate_up, bool):
            raise TypeError(f"fused_gate_up must be a bool, got {fused_gate_up!r}")
        kw = dict(dtype=dtype, device=device)
        self.hidden, self.intermediate, self.num_experts, self.k = hidden, intermediate, num_experts, k
        self.renormalize, self.capacity_factor, self.impl = renormalize, capacity_factor, impl
        self.fused_gate_up = fused_gate_up
        self.router = nn.Linear(hidden, num_experts, bias=False, **kw)
        if fused_gate_up:
            self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, **kw))
        else:
            self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate, hidden, **kw))
            self.w_up = nn.Parameter(torch.empty(num_experts, intermediate, hidden, **kw))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate, **kw))
        self.last_aux: MoEAux | None = None
        self.select = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.router.reset_parameters()
        with torch.no_grad():
            for w in (*self.gate_up(), self.w_down):     # a fused weight: each half in turn
                bound = 1.0 / math.sqrt(w.shape[-1])
                nn.init.uniform_(w, -bound, bound)

    def gate_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w_gate, w_up)``, each ``(E, F, H)``: the parameters, or views of ``w_gate_up`` when fused."""
        if self.fused_gate_up:
            return split_gate_up(self.w_gate_up)
        return self.w_gate, self.w_up

    def resolved_impl(self, x: torch.Tensor) -> str:
        """The path ``forward(x)`` takes (see ``impl`` in the class docstring)."""
        if self.impl is not None:
            return self.impl
        return "triton" if (not runtime.interpreting() and x.is_cuda) else "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up:
            args = (x, self.router.weight, None, None, self.w_down, self.k)
            kw = {"w_gate_up": self.w_gate_up}
        else:
            args = (x, self.router.weight, self.w_gate, self.w_up, self.w_down, self.k)
            kw = {}
        kw.update(renormalize=self.renormalize, capacity_factor=self.capacity_factor, select=self.select)
        if self.resolved_impl(x) == "triton":
            from llmu.moe.kernels import moe_triton  # here, so the torch path never imports Triton

            y, aux = moe_triton(*args, **kw)
        else:
            y, aux = moe_reference(*args, **kw)
        self.last_aux = aux
        return y

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts}, "
                f"k={self.k}, renormalize={self.renormalize}, capacity_factor={self.capacity_factor}, impl={self.impl}"
                + (", fused_gate_up=True" if self.fused_gate_up else ""))
