"""Compute-optimal model size and data: the Chinchilla scaling law (Hoffmann et al., 2022).

Given a training budget of ``C`` FLOPs, spent as ``C ≈ 6·N·D`` (``llmu.scale.flops``), how many
parameters ``N`` and how many tokens ``D`` give the lowest loss? Hoffmann et al. answered with three
approaches that agree that ``N`` and ``D`` should grow at about the same rate; their Chinchilla
(70B parameters, 1.4T tokens) was trained so, at the budget of Gopher (280B, 300B tokens), and beat
it. Two ways to use the result:

**The rule of thumb**: about 20 tokens per parameter. With ``D = r·N`` and ``C = 6·N·D``,

.. math::  N = \\sqrt{C / (6 r)}, \\qquad D = r N.

**The fitted law** (their approach 3): a parametric loss fitted to over 400 training runs,

.. math::  L(N, D) = E + \\frac{A}{N^\\alpha} + \\frac{B}{D^\\beta},

``E`` the entropy of text that no model removes, the two other terms what a finite model and a
finite dataset leave on the table. With the published constants ``E = 1.69``, ``A = 406.4``,
``B = 410.7``, ``α = 0.34``, ``β = 0.28`` (Hoffmann et al., section 3.3). Minimising ``L`` along
``D = C / (6N)`` (set ``dL/dN = 0``) gives the closed form

.. math::  N_\\text{opt}(C) = G \\left(\\frac{C}{6}\\right)^{\\beta/(\\alpha+\\beta)}, \\quad
           D_\\text{opt}(C) = G^{-1} \\left(\\frac{C}{6}\\right)^{\\alpha/(\\alpha+\\beta)}, \\quad
           G = \\left(\\frac{\\alpha A}{\\beta B}\\right)^{1/(\\alpha+\\beta)}.

A caution the notebook shows with numbers: these rounded constants put the optimum at far more
than 20 tokens per parameter at Chinchilla's budget. Besiroglu et al. (2024, "Chinchilla scaling:
a replication attempt") found that the published fit does not match the paper's own data or its
two other approaches, partly because of that rounding, and that a refit agrees with the ~20 tokens
per parameter of approaches 1 and 2. The rule of thumb is the figure the field uses; the law is
the shape (a valley in ``N`` at fixed ``C``, with a flat bottom).

``N`` here counts all parameters, as Chinchilla did (``llmu.moe.params.count_parameters(...).total``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmu.checks import require_positive
from llmu.moe.params import count_parameters
from llmu.scale.flops import LLAMA3_8B, LLAMA3_70B

__all__ = ["LossFit", "HOFFMANN_2022", "TOKENS_PER_PARAMETER", "rule_of_thumb", "compute_optimal",
           "isoflop_losses", "TrainedModel", "PUBLISHED_RUNS"]

#: Chinchilla's rule of thumb: compute-optimal training sees about 20 tokens per parameter.
TOKENS_PER_PARAMETER = 20.0


def _positive_number(name: str, value) -> float:
    require_positive(name, value)
    return float(value)


@dataclass(frozen=True)
class LossFit:
    """``L(N, D) = E + A / N**alpha + B / D**beta``, a fitted scaling law (nats per token)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str = ""

    def __post_init__(self):
        for key in ("E", "A", "B", "alpha", "beta"):
            _positive_number(key, getattr(self, key))

    def loss(self, n_params: float, tokens: float) -> float:
        """The predicted loss of ``n_params`` parameters trained on ``tokens`` tokens."""
        n = _positive_number("n_params", n_params)
        d = _positive_number("tokens", tokens)
        return self.E + self.A / n ** self.alpha + self.B / d ** self.beta

    @property
    def exponents(self) -> tuple[float, float]:
        """``(a, b)`` with ``N_opt ∝ C**a`` and ``D_opt ∝ C**b``: ``β/(α+β)`` and ``α/(α+β)``."""
        total = self.alpha + self.beta
        return self.beta / total, self.alpha / total


#: Hoffmann et al. (2022), approach 3, the constants as printed in section 3.3.
HOFFMANN_2022 = LossFit(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28,
                        source="Hoffmann et al. 2022, approach 3 (section 3.3)")


def rule_of_thumb(flops: float, tokens_per_parameter: float = TOKENS_PER_PARAMETER) -> tuple[float, float]:
    """``(N, D)`` that spend ``flops = 6·N·D`` with ``D = tokens_per_parameter · N``."""
    c = _positive_number("flops", flops)
    r = _positive_number("tokens_per_parameter", tokens_per_parameter)
    n = math.sqrt(c / (6.0 * r))
    return n, r * n


def compute_optimal(flops: float, fit: LossFit = HOFFMANN_2022) -> tuple[float, float]:
    """``(N_opt, D_opt)`` minimising ``fit.loss`` at ``6·N·D = flops`` (closed form, module docstring)."""
    c = _positive_number("flops", flops)
    if not isinstance(fit, LossFit):
        raise TypeError(f"fit must be a LossFit, got {type(fit).__name__}")
    a, b = fit.exponents
    g = (fit.alpha * fit.A / (fit.beta * fit.B)) ** (1.0 / (fit.alpha + fit.beta))
    return g * (c / 6.0) ** a, (c / 6.0) ** b / g


def isoflop_losses(flops: float, n_params, fit: LossFit = HOFFMANN_2022) -> list[float]:
    """The loss of each model size in ``n_params`` trained on the tokens ``flops`` buys it,
    ``D = flops / (6 N)``: one isoFLOP curve (Hoffmann et al., figure 3)."""
    c = _positive_number("flops", flops)
    return [fit.loss(n, c / (6.0 * _positive_number("n_params", n))) for n in n_params]


@dataclass(frozen=True)
class TrainedModel:
    """A published pre-training run: parameters, tokens and where the figures come from."""

    name: str
    params: float
    tokens: float
    source: str

    @property
    def flops(self) -> float:
        return 6.0 * self.params * self.tokens

    @property
    def tokens_per_parameter(self) -> float:
        return self.tokens / self.params


#: Published runs (parameters and training tokens as their authors state them). The first five are
#: Hoffmann et al. (2022), table 1; the Llama 3 models' tokens are from Meta's model card ("over 15T
#: tokens"), their parameters counted from their config.json (``llmu.scale.flops.LLAMA3_8B``, ``LLAMA3_70B``).
PUBLISHED_RUNS = [
    TrainedModel("GPT-3", 175e9, 300e9, "Brown et al. 2020; Hoffmann et al. 2022, table 1"),
    TrainedModel("Gopher", 280e9, 300e9, "Rae et al. 2021; Hoffmann et al. 2022, table 1"),
    TrainedModel("MT-NLG 530B", 530e9, 270e9, "Smith et al. 2022; Hoffmann et al. 2022, table 1"),
    TrainedModel("Chinchilla", 70e9, 1.4e12, "Hoffmann et al. 2022, table 1"),
    TrainedModel("Llama 3 8B", float(count_parameters(LLAMA3_8B).total), 15e12,
                 "Meta Llama 3 model card (over 15T tokens)"),
    TrainedModel("Llama 3 70B", float(count_parameters(LLAMA3_70B).total), 15e12,
                 "Meta Llama 3 model card (over 15T tokens)"),
]
