"""Drafts for speculative decoding: cheap ways to guess the next few tokens.

A draft only has to be *cheap* and *often right*. Whatever it proposes, the target's verification
keeps the output exact (``llmu.spec.reference``); a bad draft only wastes the work of proposing.
Every draft here implements :class:`Draft`:

- :class:`EarlyExitDraft` (self-speculative decoding): the target's own first ``k`` blocks, then
  its final norm and LM head. No second model, no training; with ``k`` of SmolLM2's 30 blocks a
  proposal costs about ``k / 30`` of a target step (plus the LM head, which every exit pays). It
  keeps its own KV cache of ``k`` layers and rewinds it like the target's.
- :class:`QuantizedDraft`: the whole target with its block weights at 4 bits and its LM head at 8
  (:mod:`llmu.spec.quantized_step`). It reads a sixth of the bytes and agrees with the target's
  greedy token almost everywhere, on any prompt; on the course's 2-core CPU a proposal still costs
  0.6 of a target step (the int4 kernel and PyTorch's dispatch), so it only breaks even there.
- :class:`NGramDraft` (prompt lookup decoding): find the most recent earlier occurrence of the
  context's last ``n`` tokens and propose what followed it. Free, and very good when the output
  copies from the input (summaries, edits, code); a deterministic draft, so its distributions are
  one-hot (``reference.one_hot_draft``).

The drafts that run a model (:class:`ModelDraft`) rewind their KV cache with :func:`rewind`: a
cache remembers which tokens it holds; before a forward pass it is cropped to the longest prefix it
shares with the new context (the rejected proposals fall off) and only the tokens after that
prefix are fed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmu.models.cache import KVCache
from llmu.models.sampling import SamplingParams, probabilities
from llmu.spec.quantized_step import QuantizedStep

__all__ = ["Draft", "ModelDraft", "EarlyExitDraft", "QuantizedDraft", "NGramDraft", "rewind", "check_params"]


def check_params(params: SamplingParams) -> SamplingParams:
    """The sampling parameters speculative decoding supports (everything but a repetition penalty,
    whose effect depends on each position's own context)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a llmu.models.sampling.SamplingParams, got {type(params).__name__}")
    if params.repetition_penalty != 1:
        raise ValueError("speculative decoding does not support repetition_penalty (it changes the "
                         "distribution of each position differently); use 1")
    return params


def rewind(cache, held: list[int], context: Sequence[int]) -> tuple[list[int], list[int]]:
    """Crop ``cache``, which holds the keys and values of the tokens ``held``, to the longest prefix
    ``held`` shares with ``context``, keeping at least the last context token to feed. ``cache`` is
    anything with ``length`` and ``crop(n)``: a ``KVCache``, or a target cache of ``llmu.spec.decode``.

    Returns ``(kept, feed)``: the tokens the cache still holds, and the tokens of ``context`` to feed
    next (never empty: the logits after the last context token are what a step needs).
    """
    if len(held) != cache.length:
        raise ValueError(f"the cache holds {cache.length} positions but {len(held)} tokens are recorded for it")
    if not context:
        raise ValueError("context must hold at least one token")
    n = 0
    limit = min(len(held), len(context) - 1)
    while n < limit and held[n] == context[n]:
        n += 1
    cache.crop(n)
    return list(context[:n]), list(context[n:])


class Draft:
    """What speculative decoding asks of a draft.

    ``begin(max_len)`` is called once per generation (room for the context and the proposals);
    ``propose(context, gamma, params, generator)`` returns up to ``gamma`` tokens to follow
    ``context`` and the distributions they were drawn from, ``(len(tokens), V)`` float32, or
    ``None`` for a deterministic draft (one-hot on each token).
    """

    name = "draft"

    def begin(self, max_len: int) -> None:  # noqa: B027 - optional hook
        pass

    def propose(self, context: Sequence[int], gamma: int, params: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        raise NotImplementedError


class ModelDraft(Draft):
    """A draft that runs a network with its own KV cache of ``cache_layers`` layers (shaped for
    ``model``): :meth:`logits` feeds tokens after what the cache holds; :meth:`propose` rewinds the
    cache to the context and takes ``gamma`` steps.

    With ``params.temperature == 0`` it proposes its own greedy tokens (one-hot distributions); else
    it samples each proposal from its distribution under the same ``params`` as the target.
    """

    def __init__(self, model, cache_layers: int):
        self.model = model
        self.cache_layers = cache_layers
        self.cache: KVCache | None = None
        self.held: list[int] = []

    def begin(self, max_len: int) -> None:
        self.cache = KVCache.for_model(self.model, 1, max_len, num_layers=self.cache_layers)
        self.held = []

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Feed ``ids`` after what the cache holds; the logits after the last one, ``(V,)``."""
        raise NotImplementedError

    def propose(self, context, gamma, params, generator=None):
        if self.cache is None:
            raise RuntimeError("call begin(max_len) before propose()")
        self.held, feed = rewind(self.cache, self.held, context)
        logits = self.logits(feed)
        tokens, dists = [], []
        for i in range(gamma):
            if params.greedy:
                token = int(logits.argmax())
            else:
                q = probabilities(logits[None], params)[0]
                token = int(torch.multinomial(q, 1, generator=generator))
                dists.append(q)
            tokens.append(token)
            if i < gamma - 1:
                logits = self.logits([token])
        return tokens, (torch.stack(dists) if dists else None)


class EarlyExitDraft(ModelDraft):
    """The first ``num_layers`` blocks of ``model``, its final norm and its LM head, as a draft."""

    def __init__(self, model, num_layers: int):
        total = model.config.num_hidden_layers
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be an int in 1..{total} (the model's blocks), got {num_layers!r}")
        super().__init__(model, num_layers)
        self.num_layers = num_layers
        self.name = f"early exit after {num_layers} of {total} blocks"

    @torch.no_grad()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        m = self.model
        x = m.embed_tokens(torch.tensor([list(ids)], device=m.device))
        cos, sin = m.rope_tables(self.cache.length, len(ids))
        for layer in m.layers[: self.num_layers]:
            x, _ = layer(x, cos, sin, backend=m.attention_backend, cache=self.cache)
        self.held += list(ids)
        return m.lm_head(m.norm(x[:, -1:]))[0, 0]


class QuantizedDraft(ModelDraft):
    """The whole ``model`` with its block weights at 4 bits (groups of ``group_size`` inputs) and its
    LM head at 8, as a draft (:class:`~llmu.spec.quantized_step.QuantizedStep`).

    The codes are computed when the draft is built (about a second for SmolLM2) from the model's
    weights as they are then: build a new draft after changing them (a stale draft only proposes
    worse; the target's verification keeps the output exact either way). The model must be one
    :class:`~llmu.models.decode_step.DecodeStep` accepts (float32, on the CPU, stock modules), with
    bias-free projections; else ``ValueError`` with the reason.
    """

    def __init__(self, model, group_size: int = 32):
        self.step = QuantizedStep(model, group_size=group_size)
        super().__init__(model, model.config.num_hidden_layers)
        self.group_size = group_size
        self.name = f"the model at 4 bits (groups of {group_size}), LM head at 8"

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        out = self.step(list(ids), self.cache, last=True)[0]
        self.held += list(ids)
        return out


class NGramDraft(Draft):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last
    ``n`` tokens, for ``n`` from ``max_ngram`` down to ``min_ngram`` (the first ``n`` that matches)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        for name, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must not exceed max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"n-gram lookup (n = {max_ngram}..{min_ngram})"

    def lookup(self, context: Sequence[int], gamma: int) -> list[int]:
        ctx = list(context)
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):  # latest occurrence before the suffix itself
                if ctx[start:start + n] == suffix:
                    return ctx[start + n:start + n + gamma]
        return []

    def propose(self, context, gamma, params, generator=None):
        return self.lookup(context, gamma), None
