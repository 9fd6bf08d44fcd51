"""Load balancing without an auxiliary loss: a per-expert bias that only the top-k choice sees.

The load-balancing loss of Switch Transformer (``reference.load_balancing_loss``) balances the
experts through the gradient: it adds a term to the loss whose gradient pushes the router's
probabilities towards even loads. That gradient competes with the language model's, and its
weight :math:`\\alpha` is a trade: large enough to balance, it costs quality; small enough not
to, it balances late. DeepSeek-V3 (DeepSeek-AI 2024, after Wang et al. 2024, "Auxiliary-loss-free
load balancing strategy for mixture-of-experts") balances without touching the loss:

1. each expert ``i`` of a layer has a bias :math:`b_i`, added to its score **for the top-k choice
   only**: ``experts = topk(p_t + b)``;
2. the gate weights come from the unbiased scores of the chosen experts, ``g = p_t[experts]``
   (renormalised when the router renormalises), so the bias changes *which* experts run and never
   *how much* each contributes; no gradient flows into it;
3. after each step, each bias moves by a fixed amount against its expert's load:
   :math:`b_i \\leftarrow b_i + u \\cdot \\operatorname{sign}(\\bar f - f_i)`, with :math:`f_i` the
   share of the step's token copies expert ``i`` received and :math:`\\bar f = 1/E` the fair share.
   An overloaded expert becomes less attractive, an idle one more, by ``u`` per step (the
   *update rate*; DeepSeek-V3 used 0.001 on sigmoid scores for most of its training).

The sign makes the step size independent of how large the imbalance is: the bias walks, it does
not jump, so a noisy batch cannot throw it far; ``u`` sets how fast it can follow the router's
drift and how much it jitters around the balance point (about ``u`` either side).

DeepSeek-V3 scores experts with a sigmoid; the course's router is a softmax (Mixtral's), so the
bias is added to the softmax probabilities here. :class:`BiasBalancer` holds one bias row per MoE
layer. ``llmu.moe.train.train(balancer=...)`` makes each MoE layer choose with
``balancer.select(layer, logits)`` and calls ``balancer.update(load)`` after every step (any
object with those two methods will do: notebook 12's exercise 5 writes its own).
"""

from __future__ import annotations

import math

import torch

from llmu.checks import require_positive
from llmu.moe.reference import router_probs

__all__ = ["BiasBalancer"]


class BiasBalancer:
    """Auxiliary-loss-free balancing for ``num_layers`` MoE layers of ``num_experts`` experts each
    (the module docstring explains the rule).

    ``bias`` ``(num_layers, E)`` float32 starts at 0. :meth:`select` is the top-k rule of one
    layer; :meth:`update` moves every bias by ``rate`` against its expert's load.
    """

    def __init__(self, num_layers: int, num_experts: int, k: int, rate: float = 1e-3, renormalize: bool = True):
        require_positive("num_layers", num_layers, integer=True)
        require_positive("num_experts", num_experts, integer=True)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
            raise ValueError(f"k must be an int with 1 <= k <= num_experts ({num_experts}), got {k!r}")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be a finite number > 0, got {rate!r}")
        self.num_layers, self.num_experts, self.k = num_layers, num_experts, k
        self.rate, self.renormalize = float(rate), bool(renormalize)
        self.bias = torch.zeros(num_layers, num_experts)

    def select(self, layer: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s choice for ``logits`` ``(T, E)``: ``(weights, experts)``, each ``(T, k)``."""
        probs = router_probs(logits)
        # -- choose with the bias: it decides which experts run
        experts = (probs + self.bias[layer].to(probs)).topk(self.k, dim=-1).indices
        # -- weigh without it: the gates are the router's own probabilities of the chosen experts
        weights = probs.gather(-1, experts)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def update(self, load: torch.Tensor) -> None:
        """Move each bias by ``rate`` towards balance: ``load`` ``(num_layers, E)`` holds each
        expert's share of the step's token copies (rows summing to 1)."""
        if not isinstance(load, torch.Tensor) or tuple(load.shape) != tuple(self.bias.shape):
            got = tuple(load.shape) if isinstance(load, torch.Tensor) else type(load).__name__
            raise ValueError(f"load must be a tensor of shape (num_layers, E) = {tuple(self.bias.shape)}, got {got}")
        fair = 1.0 / self.num_experts
        self.bias += self.rate * torch.sign(fair - load.detach().float())

    def __repr__(self) -> str:
        return (f"BiasBalancer(num_layers={self.num_layers}, num_experts={self.num_experts}, k={self.k}, "
                f"rate={self.rate:g}, renormalize={self.renormalize})")
