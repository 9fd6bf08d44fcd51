"""The speculative decoding loop: draft, verify in one target pass, keep the accepted prefix, rewind.

One **step** with a context of ``L`` tokens (the target's cache holds the first ``L - 1``)::

    draft proposes  d_1 .. d_γ                         (γ cheap forward passes, or a lookup)
    target runs     [c_L, d_1, .., d_γ]  in ONE pass   -> p_1 .. p_{γ+1}
    accept/reject   keep d_1 .. d_n, then one more token t (residual or bonus)
    rewind          the target's cache keeps L + n positions: c_1 .. c_L, d_1 .. d_n

so a step emits ``n + 1`` tokens (between 1 and ``γ + 1``) for one target pass. Decoding is
memory-bound (module 05): a pass over ``γ + 1`` tokens reads the weights once, like a pass over
one, and costs about the same. If each proposal is accepted with probability ``α`` (independently),
a step emits ``(1 - α^(γ+1)) / (1 - α)`` tokens on average.

Greedy decoding (``temperature == 0``) accepts a proposal exactly when it is the target's argmax
(``reference.greedy_accept``): the tokens are those of plain greedy decoding. Sampling uses the
accept/reject rule (``reference.accept_reject``, or the Triton kernel): the tokens are distributed
as the target's samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from llmu.models import decode_step, llama
from llmu.models.sampling import SamplingParams, probabilities
from llmu.spec import reference
from llmu.spec.drafts import Draft, check_params, rewind

__all__ = ["SpecStats", "SpecOutput", "ContiguousTarget", "speculative_generate", "expected_tokens_per_step",
           "CACHES"]

#: Where the target keeps its keys and values: module 06's contiguous cache, or module 09's pages.
CACHES = ("contiguous", "paged")


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """``(1 - α^(γ+1)) / (1 - α)``: tokens a step emits on average when every proposal is accepted
    independently with probability ``alpha`` (``γ + 1`` at ``α = 1``)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an int >= 0, got {gamma!r}")
    return float(gamma + 1) if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


class ContiguousTarget:
    """The target model over one contiguous :class:`~llmu.models.cache.KVCache` (module 06).

    The loop asks three things of a target cache (``llmu.spec.paged.PagedTarget`` answers them over
    the paged pool of module 09): ``length`` (positions it holds), ``crop(n)`` (forget every
    position from ``n`` on: rejected proposals fall off), and ``forward(ids)`` (append ``ids`` and
    return their logits, ``(len(ids), V)``).

    A pass over at most ``llmu.models.llama.SPLIT_GEMV_MAX_ROWS`` tokens (a decode step, a
    verification) of the stock model runs through :class:`llmu.models.decode_step.DecodeStep`, as
    plain generation's do, so that plain and speculative decoding are timed on the same footing.
    ``pack``: let that step copy the weights into oneDNN's layout for verification passes of
    ``decode_step.PACKED_MIN_ROWS`` tokens or more, when PyTorch can and the memory holds the copy
    (``decode_step.packing_fits``); ``packed`` says whether it did.
    """

    def __init__(self, model, max_len: int, *, pack: bool = False):
        self.model = model
        self.cache = model.new_cache(batch_size=1, max_len=max_len)
        self.step = None
        if decode_step.ENABLED and decode_step.unsupported(model, self.cache) is None:
            pack = pack and decode_step.packing_unavailable() is None and decode_step.packing_fits(model)
            self.step = decode_step.DecodeStep(model, pack=pack)

    @property
    def packed(self) -> bool:
        return self.step is not None and self.step.pack

    @property
    def length(self) -> int:
        return self.cache.length

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    def forward(self, ids: Sequence[int]) -> torch.Tensor:
        if self.step is not None and len(ids) <= llama.SPLIT_GEMV_MAX_ROWS:
            return self.step(list(ids), self.cache)
        x = torch.tensor([list(ids)], device=self.model.device)
        return self.model(x, cache=self.cache).logits[0]


def _target_cache(target, kind: str, max_len: int, block_size: int, gamma: int):
    """The target cache of ``kind`` (one of :data:`CACHES`, checked by the caller); the contiguous
    one packs its weights when the verification passes (``gamma + 1`` tokens) are long enough to
    gain from it."""
    if kind == "paged":
        from llmu.spec.paged import PagedTarget

        return PagedTarget(target, max_len, block_size=block_size)
    return ContiguousTarget(target, max_len, pack=gamma + 1 >= decode_step.PACKED_MIN_ROWS)


@dataclass
class SpecStats:
    """What a speculative generation did: per step, the proposals made and accepted; timings."""

    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    target_s: float = 0.0
    total_s: float = 0.0
    #: building the target's cache before the first step (with ``packed``, copying the weights
    #: into oneDNN's layout): a cost per model in a server, outside ``total_s``
    setup_s: float = 0.0
    packed: bool = False

    @property
    def steps(self) -> int:
        return len(self.proposed)

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposals over proposals made (``nan`` when none were made)."""
        made = sum(self.proposed)
        return sum(self.accepted) / made if made else float("nan")

    @property
    def tokens_per_step(self) -> float:
        return sum(self.emitted) / self.steps if self.steps else float("nan")


@dataclass
class SpecOutput:
    tokens: list[int]
    stats: SpecStats


@torch.no_grad()
def speculative_generate(target, draft: Draft, prompt_ids: Sequence[int], max_new_tokens: int, *, gamma: int = 4,
                         params: SamplingParams | None = None, eos_token_id: int | None = None,
                         accept_fn: Callable | None = None, cache: str = "contiguous",
                         block_size: int = 16) -> SpecOutput:
    """Up to ``max_new_tokens`` tokens after ``prompt_ids`` from ``target``, proposed by ``draft``.

    ``gamma``: proposals per step (fewer near the end, where the budget leaves less room).
    ``params``: temperature, top-k/top-p/min-p and seed (``SamplingParams``; ``temperature=0`` is
    greedy). ``eos_token_id``: stop after emitting it. ``accept_fn``: the accept/reject function
    for sampling, ``reference.accept_reject`` by default (``llmu.spec.kernels.accept_reject`` has
    the same signature). ``cache``: ``"contiguous"`` (module 06) or ``"paged"`` (module 09's block
    pool, ``block_size`` positions a block; a rejected proposal's blocks go back to the free list).
    Returns the new tokens and :class:`SpecStats`.
    """
    params = check_params(params or SamplingParams())
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids must hold at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an int >= 0 (0 = plain decoding), got {gamma!r}")
    if not isinstance(draft, Draft):
        raise TypeError(f"draft must be a llmu.spec.drafts.Draft, got {type(draft).__name__}")
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
    accept_fn = accept_fn or reference.accept_reject
    generator = torch.Generator(device="cpu").manual_seed(params.seed) if params.seed is not None else None
    max_len = len(prompt) + max_new_tokens + gamma + 1
    t0 = time.perf_counter()
    kv = _target_cache(target, cache, max_len, block_size, gamma)
    stats = SpecStats(setup_s=time.perf_counter() - t0, packed=getattr(kv, "packed", False))
    draft.begin(max_len)
    held: list[int] = []
    context, out = list(prompt), []
    start = time.perf_counter()
    while len(out) < max_new_tokens:
        # -- 1. the draft proposes (never more than the budget can take after the step's own token)
        g = min(gamma, max_new_tokens - len(out) - 1)
        t0 = time.perf_counter()
        proposal, q = draft.propose(context, g, params, generator) if g > 0 else ([], None)
        proposal = [int(t) for t in proposal][:g]
        t1 = time.perf_counter()
        # -- 2. the target scores the last context token and every proposal in one pass
        held, feed = rewind(kv, held, context)
        ids = feed + proposal
        logits = kv.forward(ids)[len(feed) - 1:]
        held = held + ids
        # -- 3. accept a prefix of the proposals, then one more token
        if params.greedy:
            accepted, nxt = reference.greedy_accept(logits.argmax(dim=-1)[None].cpu(),
                                                    torch.tensor([proposal], dtype=torch.long, device="cpu"))
        elif not proposal:  # nothing proposed: an ordinary sampling step from p_1
            r = torch.rand(1, generator=generator, device="cpu")
            accepted, nxt = torch.zeros(1, dtype=torch.long, device="cpu"), reference.inverse_cdf(
                probabilities(logits, params)[:1].cpu(), r)
        else:
            p = probabilities(logits, params)[None]
            d = torch.tensor([proposal], dtype=torch.long, device=p.device)
            qq = (q.to(p.device)[None] if q is not None
                  else reference.one_hot_draft(d, p.shape[-1]))
            u = torch.rand(1, len(proposal), generator=generator, device="cpu").to(p.device)
            r = torch.rand(1, generator=generator, device="cpu").to(p.device)
            accepted, nxt = accept_fn(p, qq, d, u, r)
        n = int(accepted[0])
        new = proposal[:n] + [int(nxt[0])]
        t2 = time.perf_counter()
        # -- 4. keep the new tokens (up to the budget and the end of sequence)
        if eos_token_id is not None and eos_token_id in new:
            new = new[: new.index(eos_token_id) + 1]
        new = new[: max_new_tokens - len(out)]
        stats.proposed.append(len(proposal))
        stats.accepted.append(n)
        stats.emitted.append(len(new))
        stats.draft_s += t1 - t0
        stats.target_s += t2 - t1
        context += new
        out += new
        if eos_token_id is not None and new[-1] == eos_token_id:
            break
    stats.total_s = time.perf_counter() - start
    return SpecOutput(out, stats)
