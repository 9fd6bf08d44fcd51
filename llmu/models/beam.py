"""Beam search: keep the ``num_beams`` most likely continuations, not only the most likely next token.

Greedy decoding commits to the best token at every step, so a continuation whose first token is a
little less likely but whose next tokens are much more likely is never looked at. Beam search keeps
``num_beams`` partial continuations (*beams*), each with the sum of its tokens' log-probabilities::

    prefill the prompt once (a cache of one row); one live beam, empty, summed log-probability 0
    for step = 1 .. max_new_tokens:
        log_softmax of the last logits of every live beam, (n, V), plus that beam's sum
        the 2 * num_beams best of the n * V candidates: one topk over the flattened scores
        walk them best first:
            a candidate ending in EOS that ranks among the first num_beams: finished, with
                score = sum_logprobs / step ** length_penalty
            a candidate ending in EOS that ranks lower: dropped
            any other candidate: a live beam, until there are num_beams
        after the last step: every live beam is finished too (length max_new_tokens)
        else, once num_beams beams have finished: stop (the live ones are dropped)
        else: reorder the cache's rows to follow each live beam's parent; feed each its new token
    return the finished beam with the highest score

Sums of log-probabilities, never products of probabilities: a product of 30 probabilities of 0.02
is about 1e-51, below float32's smallest number, and every candidate would tie at 0.

The conventions are those of Hugging Face transformers 5, ``generate(num_beams=..., do_sample=False,
early_stopping=True, length_penalty=...)``:

- a finished beam's score is ``sum_logprobs / length ** length_penalty``, ``length`` the number of
  new tokens (the prompt does not count), its EOS token included; ``length_penalty = 0`` ranks by
  the plain sum, ``> 0`` favours longer continuations (the sums are negative), ``< 0`` shorter ones.
  Live beams all have the same length, so the penalty never changes their order;
- 2 * ``num_beams`` candidates are taken so that ``num_beams`` live beams remain whatever number of
  them end in EOS; an EOS candidate ranked below ``num_beams`` is not a finished beam (transformers
  adds only the top ``num_beams``);
- ``early_stopping=True``: stop as soon as ``num_beams`` beams have finished.

``tests/models/test_beam.py`` compares sequences and scores with transformers' beam search on the
same tiny checkpoint.

**The KV cache.** A candidate's parent is ``flat_index // V``: after a step, live beam ``i``
continues beam ``parents[i]``, and two live beams may share a parent. The cache holds one row per
beam (its batch dimension), so its rows must follow: row ``i`` becomes old row ``parents[i]``, an
``index_select`` on dimension 0 of every layer's keys and values (:func:`reorder_cache`). The
first reorder grows the prompt's single row to the first beams. ``use_cache=False`` recomputes
every beam's whole sequence at every step instead (the same result, ``T`` times the work), which
is what the tests compare the cached search with.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from llmu.checks import require_token_ids
from llmu.models.cache import KVCache


class BeamSearchResult(NamedTuple):
    """The best continuation found: ``ids`` (the new tokens, its EOS included when it ended with
    one) and ``score`` (``sum_logprobs / len(ids) ** length_penalty``)."""

    ids: list[int]
    score: float


def reorder_cache(cache: KVCache, index) -> KVCache:
    """Make row ``i`` of every layer's keys and values old row ``index[i]`` (``index_select`` on the
    batch dimension); ``index`` may repeat rows and change their number (a 1-row prompt's cache
    grows to the beams). Returns ``cache``, changed in place; its length is unchanged."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a llmu.models.KVCache, got {type(cache).__name__}")
    if not isinstance(index, torch.Tensor):
        index = torch.as_tensor(index, device=cache.k[0].device)
    if index.ndim != 1 or index.numel() == 0 or index.is_floating_point() or index.dtype == torch.bool:
        raise ValueError(f"index must be a non-empty 1-D integer tensor of rows, got {index.dtype} "
                         f"shape {tuple(index.shape)}")
    rows = cache.k[0].shape[0]
    if int(index.min()) < 0 or int(index.max()) >= rows:
        raise ValueError(f"index must hold rows in [0, {rows}) of the cache, got {index.tolist()}")
    index = index.to(device=cache.k[0].device, dtype=torch.long)
    for layer in range(cache.num_layers):
        cache.k[layer] = cache.k[layer].index_select(0, index)
        cache.v[layer] = cache.v[layer].index_select(0, index)
    return cache


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def beam_search(model, prompt_ids, num_beams: int, max_new_tokens: int, eos_token_id: int | None = None,
                length_penalty: float = 1.0, *, use_cache: bool = True) -> BeamSearchResult:
    """The best continuation of ``prompt_ids`` that beam search finds (see the module's docstring).

    ``model``: called as ``model(ids (B, T), cache=..., last_only=True).logits`` ``(B, 1, V)``, with
    ``model.new_cache(batch_size, max_len)`` and ``model.device`` (a :class:`~llmu.models.LlamaModel`,
    or a stand-in with that interface). ``prompt_ids``: a list or a ``(T,)`` / ``(1, T)`` integer
    tensor, one sequence. ``eos_token_id``: the token that ends a beam (None: none does).
    ``use_cache=False`` recomputes every beam's whole sequence at each step.
    ValueError for ``num_beams`` or ``max_new_tokens`` not an int >= 1, an empty prompt, a prompt
    that leaves no room for ``max_new_tokens`` in the model's context, an ``eos_token_id`` outside
    the vocabulary and a ``length_penalty`` that is not a finite number.
    """
    config = getattr(model, "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    prompt = require_token_ids("prompt_ids", prompt_ids, vocab_size)
    num_beams = _positive_int("num_beams", num_beams)
    max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and len(prompt) + max_new_tokens > context:
        raise ValueError(f"max_new_tokens: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context of {context} positions")
    if eos_token_id is not None:
        if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, numbers.Integral) or eos_token_id < 0 \
                or (vocab_size is not None and eos_token_id >= vocab_size):
            raise ValueError(f"eos_token_id must be None or a token id in [0, {vocab_size or 'vocab_size'}), "
                             f"got {eos_token_id!r}")
        eos_token_id = int(eos_token_id)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, numbers.Real) \
            or not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if not isinstance(use_cache, bool):
        raise ValueError(f"use_cache must be a bool, got {use_cache!r}")

    device = getattr(model, "device", torch.device("cpu"))
    cache = model.new_cache(batch_size=1, max_len=len(prompt) + max_new_tokens) if use_cache else None
    feed = torch.tensor([prompt], device=device)          # the prompt, then one new token per live beam
    seqs: list[list[int]] = [[]]                          # live beams: their new tokens ...
    sums = torch.zeros(1, device=device)                  # ... and their summed log-probabilities
    finished: list[tuple[float, list[int]]] = []          # (score, ids), in the order they finished
    with torch.inference_mode():
        for step in range(1, max_new_tokens + 1):
            if not use_cache:
                feed = torch.tensor([prompt + s for s in seqs], device=device)
            logits = model(feed, cache=cache, last_only=True).logits[:, -1].float()        # (n, V)
            vocab = logits.shape[-1]
            scores = (sums[:, None] + torch.log_softmax(logits, dim=-1)).flatten()     # (n * V,)
            top, flat = scores.topk(min(2 * num_beams, scores.numel()))
            parents, tokens, kept = [], [], []
            for rank, (parent, token) in enumerate(zip((flat // vocab).tolist(), (flat % vocab).tolist())):
                if token == eos_token_id:
                    if rank < num_beams:
                        finished.append((top[rank].item() / step ** length_penalty, seqs[parent] + [token]))
                elif len(parents) < num_beams:
                    parents.append(parent)
                    tokens.append(token)
                    kept.append(rank)
            seqs = [seqs[p] + [t] for p, t in zip(parents, tokens)]
            sums = top[kept]
            if step == max_new_tokens:
                finished += [(s / step ** length_penalty, ids) for s, ids in zip(sums.tolist(), seqs)]
            elif len(finished) >= num_beams:
                break
            elif use_cache:
                reorder_cache(cache, torch.tensor(parents, device=device))
                feed = torch.tensor(tokens, device=device)[:, None]
    score, ids = max(finished, key=lambda f: f[0])
    return BeamSearchResult(ids, score)
