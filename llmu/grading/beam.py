"""How notebook 02 grades the learner's beam search (exercise 5): a stand-in model whose logits are
a table, the search that tries every sequence, and a call that checks what the learner returns.

:class:`TableModel` has exactly the interface the exercise lets the learner rely on:
``model.new_cache(batch_size, max_len)`` (a real :class:`~llmu.models.KVCache`),
``model(ids, cache=..., last_only=...)`` with ``.logits``, and ``model.device``. Its next-token
logits are a fixed function of the *whole* sequence so far (prompt and new tokens): hand-written
entries of ``table``, else random numbers drawn from a generator seeded by the sequence. It keeps
the sequence in its cache (each token id is the one "key" of its position), so a search that does
not reorder the cache's rows after choosing the beams makes it read another beam's past, and its
logits change, exactly as a real model's would. It counts the tokens it is fed (``tokens_fed``):
a search that uses the cache feeds the prompt once and then one token per live beam per step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace

import torch

from llmu.models.cache import KVCache

from .errors import CheckFailed

__all__ = ["TableModel", "call_beam_search", "exhaustive_search"]


class TableModel:
    """A language model whose next-token logits are a table indexed by the whole sequence so far.

    ``table`` maps a sequence (a tuple of token ids, prompt included) to the logits of the token
    after it (``vocab_size`` numbers), ``probs`` to its probabilities (kept as their logs); any other sequence
    gets ``scale * N(0, 1)`` logits from a generator seeded by ``seed`` and the sequence, or with
    ``markov=True`` by ``seed`` and the sequence's last token only: then the past does not matter,
    and a search that mixes up its beams' caches still gets the right logits (to tell that mistake
    from the others).
    """

    def __init__(self, vocab_size: int, seed: int = 0, *, scale: float = 2.0,
                 table: Mapping[tuple[int, ...], Sequence[float]] | None = None,
                 probs: Mapping[tuple[int, ...], Sequence[float]] | None = None, markov: bool = False):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
        self.vocab_size, self.seed, self.scale, self.markov = vocab_size, seed, scale, bool(markov)
        # on the CPU whatever torch's default device (the notebook's tests may run with cuda as default)
        self.table = {tuple(k): torch.as_tensor(v, dtype=torch.float32, device="cpu") for k, v in (table or {}).items()}
        self.table |= {tuple(k): torch.as_tensor(v, dtype=torch.float64, device="cpu").log().float()
                       for k, v in (probs or {}).items()}
        for k, v in self.table.items():
            if v.shape != (vocab_size,):
                raise ValueError(f"table[{k}] must hold {vocab_size} logits, got shape {tuple(v.shape)}")
        self.device = torch.device("cpu")
        self.tokens_fed = 0
        self.calls = 0

    def logits_after(self, seq: Sequence[int]) -> torch.Tensor:
        """The logits of the token that follows ``seq`` (prompt included), ``(V,)`` float32."""
        seq = tuple(int(t) for t in seq)
        if seq in self.table:
            return self.table[seq].clone()
        h = self.seed & 0xFFFFFFFF
        for t in seq[-1:] if self.markov else seq:
            h = (h * 1_000_003 + t + 1) % (1 << 61)
        g = torch.Generator().manual_seed(h)
        return torch.randn(self.vocab_size, generator=g, device="cpu") * self.scale

    def log_probs_after(self, seq: Sequence[int]) -> torch.Tensor:
        return torch.log_softmax(self.logits_after(seq), dim=-1)

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """A cache of one layer and one "head" of size 1: position ``t`` of row ``b`` holds token ``t``."""
        return KVCache(1, batch_size, 1, max_len or 256, 1, device="cpu")

    def __call__(self, input_ids, *, cache: KVCache | None = None, last_only: bool = False):
        ids = torch.as_tensor(input_ids, device="cpu")
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.numel() == 0 or ids.is_floating_point():
            raise ValueError(f"input_ids must be (batch, seq) integer token ids, got {ids.dtype} {tuple(ids.shape)}")
        self.calls += 1
        self.tokens_fed += ids.numel()
        ids = ids.to("cpu", torch.long)
        if cache is not None:
            x = ids.to(torch.float32)[:, None, :, None]   # (B, 1, T, 1): the token ids as keys
            keys, _ = cache.append(0, x, x)               # every position so far, row by row
            seqs = keys[:, 0, :, 0].round().long()
        else:
            seqs = ids
        total, new = seqs.shape[1], ids.shape[1]
        ends = [total] if last_only else range(total - new + 1, total + 1)
        logits = torch.stack([torch.stack([self.logits_after(row[:end].tolist()) for end in ends])
                              for row in seqs])
        return SimpleNamespace(logits=logits)


def exhaustive_search(model: TableModel, prompt_ids: Sequence[int], max_new_tokens: int,
                      eos_token_id: int | None = None, length_penalty: float = 1.0) -> tuple[list[int], float]:
    """The best of *every* continuation, scored as beam search scores a finished beam: each sequence
    of ``max_new_tokens`` tokens without EOS, and each that ends at its first EOS earlier or at the
    last step; score ``sum_logprobs / length ** length_penalty`` (EOS counted). ``V ** max_new_tokens``
    sequences: for tiny vocabularies only."""
    prompt = [int(t) for t in prompt_ids]
    best: tuple[float, list[int]] | None = None

    def consider(seq, total):
        nonlocal best
        score = total / len(seq) ** length_penalty
        if best is None or score > best[0]:
            best = (score, list(seq))

    for seq in itertools.product(range(model.vocab_size), repeat=max_new_tokens):
        total = 0.0
        for i, t in enumerate(seq):
            total += float(model.log_probs_after(prompt + list(seq[:i]))[t])
            if t == eos_token_id:
                if all(x == 0 for x in seq[i + 1:]):   # count each EOS-ended sequence once
                    consider(seq[: i + 1], total)
                break
        else:
            consider(seq, total)
    assert best is not None
    return best[1], best[0]


def call_beam_search(fn: Callable, model, prompt_ids, num_beams: int, max_new_tokens: int,
                     eos_token_id: int | None = None, length_penalty: float = 1.0, *, what: str) -> tuple[list[int], float]:
    """``fn(model, prompt_ids, num_beams, max_new_tokens, eos_token_id, length_penalty)``, checked to
    return ``(ids, score)``: a list of int token ids (at least one) and a finite float. Any exception
    fails the check named ``what`` with what was raised."""
    call = (f"my_beam_search(model, {list(prompt_ids)}, num_beams={num_beams}, max_new_tokens={max_new_tokens}, "
            f"eos_token_id={eos_token_id}, length_penalty={length_penalty})")
    try:
        out = fn(model, list(prompt_ids), num_beams, max_new_tokens, eos_token_id, length_penalty)
    except Exception as exc:  # noqa: BLE001 - reported as the check's failure
        raise CheckFailed(f"{what}: {call} raised {type(exc).__name__}({exc})") from exc
    if not (isinstance(out, tuple) and len(out) == 2):
        raise CheckFailed(f"{what}: {call} returned a {type(out).__name__}, not a tuple (ids, score)\n"
                          "  Look at: return ids, score")
    ids, score = out
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise CheckFailed(f"{what}: {call} returned ids {ids!r}; expected a non-empty list of int token ids "
                          "(the new tokens, without the prompt)")
    if eos_token_id is not None and eos_token_id in ids[:-1]:
        raise CheckFailed(f"{what}: {call} returned ids with EOS ({eos_token_id}) before their end, at index "
                          f"{ids.index(eos_token_id)} of {len(ids)}\n"
                          "  Look at: a beam that emits EOS is finished: it leaves the live beams and is never expanded")
    if isinstance(score, torch.Tensor) and score.numel() == 1:
        score = score.item()
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise CheckFailed(f"{what}: {call} returned score {score!r}; expected a finite float "
                          "(sum_logprobs / len(ids) ** length_penalty)")
    return ids, float(score)
