"""AdamW written out: the optimizer that trains almost every LLM, one line per idea.

For every parameter ``w`` with gradient ``g``, step ``t`` (counted from 1) does, in this order:

1. **Decoupled weight decay** (Loshchilov & Hutter, 2019): ``w ← w · (1 − lr · λ)``. The decay
   shrinks the weight directly. Adam with *coupled* (L2) decay adds ``λ · w`` to the gradient
   instead, and then Adam's per-coordinate scaling divides it by ``√v̂``: weights with large
   gradients would hardly be regularized at all. Decoupling keeps the pull towards 0 the same for
   every coordinate.
2. **First moment**, a running mean of the gradient: ``m ← β₁ · m + (1 − β₁) · g``.
3. **Second moment**, a running mean of its square: ``v ← β₂ · v + (1 − β₂) · g²``.
4. **Bias correction.** ``m`` and ``v`` start at 0, so early on they are averages of too few
   terms, shrunk towards 0: after ``t`` steps their weights sum to ``1 − βᵗ``, not 1. Dividing by
   that sum gives the unbiased ``m̂ = m / (1 − β₁ᵗ)`` and ``v̂ = v / (1 − β₂ᵗ)``.
5. **The update**: ``w ← w − lr · m̂ / (√v̂ + ε)``. Each coordinate moves by about ``lr`` in the
   direction of its recent gradients, whatever their scale; ``ε`` (outside the square root) keeps
   coordinates whose gradient is ~0 from dividing by ~0.

:class:`AdamW` follows ``torch.optim.AdamW``'s single-tensor implementation
(``_single_tensor_adam`` in ``torch/optim/adam.py``, the ``foreach=False`` path) operation for
operation: ``m`` is updated with ``lerp_`` (``m + (1 − β₁)(g − m)``, the same number as step 2 up
to rounding), bias corrections are Python floats, and the update is one ``addcdiv_`` with
``−lr / (1 − β₁ᵗ)``. Float arithmetic is not associative, so another order of the same formula
drifts by a few ulps a step; this order gives the very same bits as torch's
(``tests/training/test_adamw.py``).

The state of a parameter holds the keys torch uses, ``step`` (a float32 scalar tensor),
``exp_avg`` (``m``) and ``exp_avg_sq`` (``v``), so ``state_dict()``/``load_state_dict()`` (from
``torch.optim.Optimizer``) and ``llmu.training.loop.optimizer_state_memory`` treat it like torch's.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(3))
>>> opt = AdamW([w], lr=0.1, weight_decay=0.0)
>>> w.grad = torch.tensor([1.0, -2.0, 0.0])
>>> opt.step()
>>> w.data            # the first step moves each coordinate by lr against its gradient's sign
tensor([0.9000, 1.1000, 1.0000])
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["AdamW"]


def _number(name: str, value, low: float, high: float | None = None) -> float:
    """``value`` as a float in ``[low, high)`` (``[low, inf)`` without ``high``), else
    TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not (value >= low and (high is None or value < high)):   # `not >=` also refuses NaN
        raise ValueError(f"{name} must be in [{low}, {'inf' if high is None else high}), got {value}")
    return value


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay and bias correction (module docstring).

    ``params``: an iterable of tensors or of parameter-group dicts (each may set its own ``lr``,
    ``betas``, ``eps``, ``weight_decay``), as for every torch optimizer. The defaults are
    ``torch.optim.AdamW``'s. ``amsgrad``, ``maximize``, sparse and complex gradients are not
    supported and raise.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, amsgrad: bool = False):
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by llmu's AdamW (use torch.optim.AdamW(amsgrad=True))")
        defaults = self._checked(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        super().__init__(params, defaults)

    @staticmethod
    def _checked(group: dict) -> dict:
        """The hyperparameters of a group, validated: lr, eps, weight_decay >= 0; betas two numbers in [0, 1)."""
        _number("lr", group["lr"], 0.0)
        _number("eps", group["eps"], 0.0)
        _number("weight_decay", group["weight_decay"], 0.0)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        _number("betas[0]", betas[0], 0.0, 1.0)
        _number("betas[1]", betas[1], 0.0, 1.0)
        return group

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)              # fills in the defaults
        if param_group.get("amsgrad"):
            raise ValueError("amsgrad=True is not supported by llmu's AdamW")
        self._checked(self.param_groups[-1])              # a group's own values are checked too

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient (``p.grad is None``: left as is, and
        its step count does not advance). ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            eps, weight_decay = group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise ValueError("AdamW does not support sparse gradients")
                if torch.is_complex(p):
                    raise ValueError("llmu's AdamW does not support complex parameters")
                state = self.state[p]
                if not state:                             # created lazily, at a parameter's first step
                    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                    state["step"] = torch.tensor(0.0, dtype=scalar)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]

                step_t += 1
                # 1. decoupled weight decay, before the moments: w <- w (1 - lr λ)
                if weight_decay != 0:
                    p.mul_(1 - lr * weight_decay)
                # 2. m <- β1 m + (1 - β1) g, written as m + (1 - β1)(g - m)
                exp_avg.lerp_(grad, 1 - beta1)
                # 3. v <- β2 v + (1 - β2) g²
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                # 4. bias corrections, as Python floats
                step = step_t.item()
                bias_correction1 = 1 - beta1 ** step
                bias_correction2 = 1 - beta2 ** step
                step_size = lr / bias_correction1
                # 5. w <- w - lr m̂ / (√v̂ + ε), with m̂'s correction folded into the step size
                denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss
