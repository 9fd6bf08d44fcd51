"""Turning next-token logits into a choice: the logits processors of text generation.

Each processor takes logits ``(B, V)`` and returns new logits of the same shape; a token a filter
removes gets ``-inf`` (probability zero after the softmax). :func:`process_logits` applies them in
the order Hugging Face's ``generate`` does: repetition penalty, temperature, top-k, top-p, min-p.
Then :func:`sample` draws from ``softmax(logits)``, or :func:`greedy` takes the argmax.

- temperature ``T``: ``softmax(z / T)``; ``T < 1`` sharpens, ``T > 1`` flattens; ``T -> 0`` is greedy.
- top-k: keep the ``k`` most likely tokens.
- top-p (nucleus): keep the smallest set of most likely tokens whose probabilities add up to at
  least ``p``.
- min-p: keep the tokens at least ``min_p`` times as likely as the most likely one (the cut
  adapts: strict when the model is sure, loose when it is not).
- repetition penalty ``r`` (CTRL, Keskar et al. 2019): for every token already in the context,
  a positive logit is divided by ``r``, a negative one multiplied by ``r``; both make it less
  likely for ``r > 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _check_logits(logits: torch.Tensor) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point torch.Tensor")
    if logits.ndim not in (1, 2):
        raise ValueError(f"logits must be (vocab,) or (batch, vocab), got shape {tuple(logits.shape)}")
    return logits


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``."""
    _check_logits(logits)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (exactly ``k``: ties at the cut are broken by index)."""
    _check_logits(logits)
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"top_k must be a positive int, got {k!r}")
    if k >= logits.shape[-1]:
        return logits
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep.scatter_(-1, logits.topk(k, dim=-1).indices, True)
    return logits.masked_fill(~keep, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose total probability is at least ``p``.

    Sorted by probability, token ``j`` is kept when the tokens before it sum to less than ``p``:
    the first one is always kept, and the one that crosses ``p`` too.
    """
    _check_logits(logits)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p!r}")
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.float().softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass of the tokens ranked above
    drop_sorted = before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep the tokens whose probability is at least ``min_p`` times the largest probability."""
    _check_logits(logits)
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    if min_p == 0:
        return logits
    probs = logits.float().softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def repetition_penalty(logits: torch.Tensor, context_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """Penalise every token that occurs in ``context_ids`` (``(B, T)`` or ``(T,)``), once per token.

    Same rule as transformers' ``RepetitionPenaltyLogitsProcessor``: ``z / penalty`` where ``z > 0``,
    ``z * penalty`` where ``z < 0``. ``penalty = 1`` changes nothing.
    """
    _check_logits(logits)
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not penalty > 0:
        raise ValueError(f"repetition_penalty must be a positive number, got {penalty!r}")
    if penalty == 1 or context_ids is None or context_ids.numel() == 0:
        return logits
    squeeze = logits.ndim == 1
    z = logits[None] if squeeze else logits
    ids = context_ids.reshape(z.shape[0], -1).to(device=z.device, dtype=torch.long)
    picked = z.gather(-1, ids)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    out = z.scatter(-1, ids, picked)
    return out[0] if squeeze else out


@dataclass
class SamplingParams:
    """How to pick the next token. ``temperature=0`` (the default) is greedy decoding.

    ``top_k=0``, ``top_p=1``, ``min_p=0`` and ``repetition_penalty=1`` switch a processor off.
    ``seed`` makes sampling reproducible (a private ``torch.Generator``).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        mp = self.min_p
        if isinstance(mp, bool) or not isinstance(mp, (int, float)) or not 0 <= mp <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {mp!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0:
            raise ValueError(f"repetition_penalty must be a positive number (1 = off), got {r!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: torch.Tensor, context_ids: torch.Tensor | None, params: SamplingParams) -> torch.Tensor:
    """Apply the processors ``params`` switches on, in Hugging Face's order."""
    if params.repetition_penalty != 1 and context_ids is not None:
        logits = repetition_penalty(logits, context_ids, params.repetition_penalty)
    if params.greedy:
        return logits  # the filters below never change the argmax
    logits = apply_temperature(logits, params.temperature)
    if params.top_k:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p < 1:
        logits = top_p_filter(logits, params.top_p)
    if params.min_p > 0:
        logits = min_p_filter(logits, params.min_p)
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams,
                  context_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution ``params`` draws the next token from: ``softmax`` of the processed logits,
    float32 (speculative decoding needs it explicitly, to compare a draft's with the target's)."""
    return process_logits(logits.float(), context_ids, params).softmax(dim=-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row, ``(B,)``."""
    return _check_logits(logits).argmax(dim=-1)


def sample(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from ``softmax(logits)``, ``(B,)`` (``(,)`` for 1-D logits)."""
    _check_logits(logits)
    probs = logits.float().softmax(dim=-1)
    if probs.ndim == 1:
        return torch.multinomial(probs, 1, generator=generator)[0]
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def next_token(logits: torch.Tensor, context_ids: torch.Tensor | None, params: SamplingParams,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Process ``logits`` and pick the next token of each row (argmax when greedy, else a draw)."""
    logits = process_logits(logits, context_ids, params)
    return greedy(logits) if params.greedy else sample(logits, generator)
