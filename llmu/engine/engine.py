"""The serving engine: requests in, text out, one packed forward pass per step.

::

    engine = LLMEngine(model, tokenizer)                    # a paged KV pool, a scheduler, a runner
    outs = engine.generate(["Hi!", "Tell me a story"], SamplingParams(max_tokens=64))
    for event in engine.stream(prompts, params): ...       # text pieces as they come, per request

Each :meth:`LLMEngine.step`:

1. asks the :class:`~llmu.engine.scheduler.Scheduler` for the step's work (who runs, how many
   positions each, which blocks to copy, who was preempted);
2. lets the :class:`~llmu.engine.model_runner.ModelRunner` run the model once over all of it;
3. samples a token for every sequence that reached its last position, appends it, and checks
   whether the sequence is done (end-of-sequence token, stop string, ``max_tokens``): a finished
   sequence returns its blocks at once, and the next step can admit someone in its place.

Every request that was accepted ends with a ``finish_reason``; a request that could never fit
(prompt plus ``max_tokens`` beyond the context or beyond the whole pool) is refused by
:meth:`add_request` with a ``ValueError`` instead of being accepted and dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from llmu.engine.model_runner import ModelRunner
from llmu.engine.scheduler import Scheduler, SchedulerConfig
from llmu.engine.sequence import SamplingParams, Sequence, Status
from llmu.models.generate import _held_back, prompt_to_ids
from llmu.paged.block_manager import BlockManager
from llmu.paged.cache import PagedKVCache

__all__ = ["LLMEngine", "RequestOutput", "CompletionOutput", "StreamEvent", "EngineStats", "DEFAULT_KV_BYTES"]

#: KV pool size when neither ``num_blocks`` nor ``kv_memory_bytes`` is given.
DEFAULT_KV_BYTES = 256 * 2**20


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    preemptions: int = 0


@dataclass
class RequestOutput:
    """A request's result: its prompt, its ``n`` samples, and when things happened (seconds)."""

    request_id: int
    prompt: object
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    cached_tokens: int = 0  # prompt positions the prefix cache supplied
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class StreamEvent:
    """New text of one sample of one request (``finished`` on its last event)."""

    request_id: int
    index: int
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class EngineStats:
    """Counters since the engine was made (or since :meth:`LLMEngine.reset_stats`)."""

    steps: int = 0
    positions_computed: int = 0  # positions run through the model (prompts, recomputation, decoding)
    generated_tokens: int = 0
    prefix_cached_tokens: int = 0  # prompt positions the prefix cache supplied instead
    preemptions: int = 0
    copies: int = 0  # blocks copied on write
    model_s: float = 0.0  # time in forward passes and sampling
    wall_s: float = 0.0  # time inside step()
    peak_running: int = 0
    peak_used_blocks: int = 0
    kv_used_positions: int = 0  # summed over steps: positions holding keys/values ...
    kv_allocated_positions: int = 0  # ... and positions allocated to sequences

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of engine time."""
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def kv_waste(self) -> float:
        """Fraction of allocated KV positions that held nothing, averaged over steps."""
        if not self.kv_allocated_positions:
            return float("nan")
        return 1 - self.kv_used_positions / self.kv_allocated_positions


@dataclass
class _Request:
    request_id: int
    prompt: object
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False


class LLMEngine:
    """Continuous batching over a paged KV cache, on any ``llmu.models`` model.

    Memory: ``num_blocks`` blocks of ``block_size`` positions, or as many as ``kv_memory_bytes``
    holds (default :data:`DEFAULT_KV_BYTES`). Scheduling: see :class:`SchedulerConfig`
    (``max_num_seqs``, ``max_num_batched_tokens``, ``chunked_prefill``, ``policy``, ``reserve``,
    ``max_model_len``). ``prefix_caching`` shares blocks between prompts that start alike.
    ``attention``: ``"triton"``, ``"torch"`` or ``"reference"`` (default: Triton on a GPU, torch on a CPU).
    """

    def __init__(self, model, tokenizer=None, *, num_blocks: int | None = None, kv_memory_bytes: int | None = None,
                 block_size: int = 16, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 chunked_prefill: bool = True, prefix_caching: bool = True, policy: str = "continuous",
                 reserve: str = "blocks", max_model_len: int | None = None, attention: str | None = None):
        if num_blocks is None and kv_memory_bytes is None:
            kv_memory_bytes = DEFAULT_KV_BYTES
        max_model_len = max_model_len if max_model_len is not None else model.config.max_position_embeddings
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not 0 < max_model_len:
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        if max_model_len > model.config.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's context of "
                             f"{model.config.max_position_embeddings} positions")
        self.model, self.tokenizer = model, tokenizer
        self.pool = PagedKVCache.for_model(model, num_blocks=num_blocks, memory_bytes=kv_memory_bytes,
                                           block_size=block_size)
        self.block_manager = BlockManager(self.pool.num_blocks, block_size, prefix_caching=prefix_caching)
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      chunked_prefill=chunked_prefill, policy=policy, reserve=reserve,
                                      max_model_len=max_model_len)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.runner = ModelRunner(model, self.pool, impl=attention)
        self.eos_ids = set(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self._requests: dict[int, _Request] = {}
        self._next_id = itertools.count()
        self.stats = EngineStats()

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None) -> int:
        """Queue ``prompt`` (text, chat messages, or token ids); return its request id.

        Raises ``ValueError`` when the request can never run: an empty prompt, a token id outside
        the model's vocabulary, prompt plus ``max_tokens`` beyond ``max_model_len``, or more blocks
        than the whole pool has; ``TypeError`` for a prompt or ``params`` of the wrong type.
        """
        ids, params = self._check_request(prompt, params)
        rid = next(self._next_id)
        req = _Request(rid, prompt, ids, params)
        req.seqs.append(self._new_sequence(req, 0, list(ids)))
        self._requests[rid] = req
        self.scheduler.add(req.seqs[0])  # the other n-1 samples fork from it after its prefill
        return rid

    def _check_request(self, prompt, params) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the parameters, or a ValueError/TypeError if it can never run."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be an llmu.engine.SamplingParams, got {type(params).__name__}")
        # a copy through the constructor: its checks run again, whatever was assigned to its fields since
        params = dataclasses.replace(params)
        # ids outside the vocabulary would fail inside a batched step (an IndexError on a CPU, a
        # device-side assert on a GPU) and take every other request down with it: refuse them here
        ids = prompt_to_ids(self.tokenizer, prompt, self.model.config.vocab_size)
        cfg, bm = self.config, self.block_manager
        need = len(ids) + params.max_tokens
        if need > cfg.max_model_len:
            raise ValueError(f"prompt: {len(ids)} prompt tokens + max_tokens {params.max_tokens} = {need} positions, "
                             f"more than the context of max_model_len={cfg.max_model_len}")
        reserve = cfg.max_model_len if cfg.reserve == "context" else need
        if bm.blocks_for(reserve) + 1 > bm.num_blocks:
            raise ValueError(f"prompt: this request needs up to {bm.blocks_for(reserve)} blocks of {bm.block_size} "
                             f"positions, but the KV pool has {bm.num_blocks} in all (one kept spare); "
                             f"give the engine more num_blocks / kv_memory_bytes")
        if not cfg.chunked_prefill and len(ids) > cfg.max_num_batched_tokens:
            raise ValueError(f"prompt: {len(ids)} tokens do not fit one step of max_num_batched_tokens="
                             f"{cfg.max_num_batched_tokens} without chunked_prefill")
        return ids, params

    def _check_all(self, prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
        """The prompts and one SamplingParams per prompt, every request checked."""
        prompts = self._prompt_list(prompts)
        params = self._params_list(prompts, sampling_params)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                self._check_request(p, sp)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from None
        return prompts, params

    def _add_all(self, prompts, sampling_params) -> list[int]:
        """Check every prompt first, then queue them all: one bad prompt queues none."""
        prompts, params = self._check_all(prompts, sampling_params)
        return [self.add_request(p, sp) for p, sp in zip(prompts, params)]

    def _new_sequence(self, req: _Request, index: int, token_ids: list[int]) -> Sequence:
        generator = None
        if not req.params.greedy:
            generator = torch.Generator(device=self.model.device)
            if req.params.seed is not None:
                generator.manual_seed(req.params.seed + index)
            else:
                generator.seed()
        return Sequence(req.request_id, index, token_ids, len(req.prompt_ids), req.params, generator)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def unfinished_requests(self) -> list[int]:
        """Ids of the requests that still have a sample running or waiting."""
        return [rid for rid, req in self._requests.items() if not all(s.is_finished for s in req.seqs)]

    def abort(self, request_id: int) -> None:
        """Stop a request now (its samples finish with reason ``"abort"``)."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id}")
        for seq in req.seqs:
            if not seq.is_finished:
                if seq in self.scheduler.waiting:
                    self.scheduler.waiting.remove(seq)
                self.scheduler.finish(seq, "abort")

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[StreamEvent]:
        """Schedule, run the model once, sample; return the new text of every sample that moved."""
        t0 = time.perf_counter()
        sched, bm, stats = self.scheduler, self.block_manager, self.stats
        batch = sched.schedule()
        stats.preemptions += len(batch.preempted)
        if not batch:
            stats.wall_s += time.perf_counter() - t0
            return []
        stats.positions_computed += batch.num_tokens
        stats.prefix_cached_tokens += batch.cached_tokens
        stats.copies += len(batch.copies)
        t1 = time.perf_counter()
        sampling, logits = self.runner.forward(batch, bm.tables)
        sched.computed(batch)
        # the n - 1 sister samples of a request fork from its first sequence right after its prefill
        rows = list(range(len(sampling)))
        for i, seq in list(enumerate(sampling)):
            req = self._requests[seq.request_id]
            if req.params.n > 1 and not req.forked and seq.index == 0:
                req.forked = True
                for j in range(1, req.params.n):
                    child = self._new_sequence(req, j, list(seq.token_ids))
                    child.num_computed, child.status = seq.num_computed, Status.RUNNING
                    bm.fork(seq.seq_id, child.seq_id)
                    sched.running.append(child)
                    req.seqs.append(child)
                    sampling.append(child)
                    rows.append(i)
        tokens = self.runner.sample(sampling, logits[rows])
        stats.model_s += time.perf_counter() - t1
        events = [self._append(seq, tok) for seq, tok in zip(sampling, tokens)]
        stats.steps += 1
        stats.peak_running = max(stats.peak_running, len(sched.running) + sum(1 for s in sampling if s.is_finished))
        stats.peak_used_blocks = max(stats.peak_used_blocks, bm.num_used_blocks)
        stats.kv_allocated_positions += sum(len(t) for t in bm.tables.values()) * bm.block_size
        stats.kv_used_positions += sum(s.num_computed for s in sched.running)
        stats.wall_s += time.perf_counter() - t0
        return [e for e in events if e is not None]

    def _append(self, seq: Sequence, token: int) -> StreamEvent | None:
        """Add ``token`` to ``seq``, decide whether it is done, and return its new text."""
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        params, reason = seq.params, None
        new_ids: list[int] = []
        if token in self.eos_ids and not params.ignore_eos:
            reason = "eos"  # the end-of-sequence token itself is not part of the output
        else:
            seq.token_ids.append(token)
            new_ids.append(token)
            self.stats.generated_tokens += 1
            if seq.num_output_tokens >= params.max_tokens:
                reason = "length"
        piece = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_ids)
            hits = [h for h in (text.find(s, max(0, seq.emitted - len(s))) for s in params.stop) if h >= 0]
            if hits:
                text, reason = text[: min(hits)], "stop"
            seq.text = text
            ready = len(text) if reason else len(text) - _held_back(text, params.stop)
            if ready > seq.emitted:
                piece = text[seq.emitted : ready]
                seq.emitted = ready
        if reason is not None:
            seq.finish_time = now
            self.scheduler.finish(seq, reason)
        if not piece and not new_ids and reason is None:
            return None
        return StreamEvent(seq.request_id, seq.index, piece, new_ids, reason is not None, reason)

    # -- whole workloads ------------------------------------------------------------------------
    def _params_list(self, prompts: list, sampling_params) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or SamplingParams()] * len(prompts)
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: give one SamplingParams or one per prompt ({len(prompts)}), "
                             f"got {len(params)}")
        return params

    @staticmethod
    def _prompt_list(prompts) -> list:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
            return [prompts]  # one text, or one chat conversation
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
            return [prompts]  # one list of token ids
        return list(prompts)

    def stream(self, prompts, sampling_params=None) -> Iterator[StreamEvent]:
        """Add every prompt, then run steps until all are done, yielding their text as it comes.

        The prompts are checked when this is called (a bad one raises here); they are queued
        when the first event is asked for."""
        prompts, params = self._check_all(prompts, sampling_params)
        return self._stream(prompts, params)

    def _stream(self, prompts: list, params: list[SamplingParams]) -> Iterator[StreamEvent]:
        for p, sp in zip(prompts, params):
            self.add_request(p, sp)
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts, sampling_params: SamplingParams | Iterable[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run ``prompts`` (a list of texts / chat conversations / token-id lists) to completion.

        Returns one :class:`RequestOutput` per prompt, in order.
        """
        ids = self._add_all(prompts, sampling_params)
        while self.has_unfinished():
            self.step()
        return [self.output(rid) for rid in ids]

    def output(self, request_id: int) -> RequestOutput:
        """The current state of a request (final once every sample has a ``finish_reason``)."""
        req = self._requests[request_id]
        seqs = sorted(req.seqs, key=lambda s: s.index)
        first = [s.first_token_time for s in seqs if s.first_token_time is not None]
        done = [s.finish_time for s in seqs if s.finish_time is not None]
        return RequestOutput(
            request_id, req.prompt, list(req.prompt_ids),
            [CompletionOutput(s.index, s.text, s.output_ids, s.finish_reason, s.preemptions) for s in seqs],
            cached_tokens=seqs[0].cached_tokens, arrival_time=seqs[0].arrival_time,
            first_token_time=min(first) if first else None,
            finish_time=max(done) if len(done) == len(seqs) and len(seqs) == req.params.n else None,
        )

    def reset_stats(self) -> None:
        self.stats = EngineStats()

    def __repr__(self) -> str:
        c = self.config
        return (f"LLMEngine({self.pool!r}, policy={c.policy!r}, reserve={c.reserve!r}, max_num_seqs={c.max_num_seqs}, "
                f"max_num_batched_tokens={c.max_num_batched_tokens}, chunked_prefill={c.chunked_prefill}, "
                f"prefix_caching={self.block_manager.prefix_caching})")
