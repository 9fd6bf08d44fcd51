"""A request as the engine sees it: its tokens, how far its keys and values are computed, how it ends.

A :class:`Sequence` is one stream of tokens (a request asking for ``n`` samples becomes ``n``
sequences). Two counters drive everything the scheduler does:

- ``num_tokens``: prompt plus generated tokens so far;
- ``num_computed``: the leading positions whose keys and values are in the paged cache.

While ``num_computed < num_tokens`` the sequence still has positions to compute: its prompt (all
of it at once, or chunk by chunk with chunked prefill; minus what the prefix cache already
holds), or, while decoding, the one token sampled last step. When a step computes its last
position the logits there give the next token.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from llmu.models.sampling import SamplingParams as _BaseSamplingParams

__all__ = ["SamplingParams", "Sequence", "Status", "FINISH_REASONS"]

#: Why a sequence ended: an end-of-sequence token, a stop string, ``max_tokens`` reached, or the
#: model's context full.
FINISH_REASONS = ("eos", "stop", "length", "context")


@dataclass
class SamplingParams(_BaseSamplingParams):
    """How to decode one request: the sampling of ``llmu.models.sampling`` plus

    ``max_tokens`` (new tokens at most), ``stop`` (strings that end the text, cut off),
    ``n`` (independent samples of the prompt: they share its blocks until they diverge),
    ``ignore_eos`` (keep going after an end-of-sequence token, for benchmarks).
    """

    max_tokens: int = 64
    stop: tuple[str, ...] | list[str] | str = ()
    n: int = 1
    ignore_eos: bool = False

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty str or a list of them, got {self.stop!r}")
        self.stop = tuple(self.stop)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


class Status(enum.Enum):
    WAITING = "waiting"  # queued: no blocks (new, or preempted and waiting to be recomputed)
    RUNNING = "running"  # holds blocks, scheduled every step
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One sequence of tokens being generated."""

    request_id: int
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    num_computed: int = 0
    finish_reason: str | None = None
    preemptions: int = 0
    cached_tokens: int = 0  # prompt positions the prefix cache supplied on admission
    text: str = ""  # decoded output (when the engine has a tokenizer)
    emitted: int = 0  # characters of ``text`` already streamed
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id}.{self.index}, {self.status.value}, "
                f"tokens={self.num_tokens} (prompt {self.num_prompt_tokens}), computed={self.num_computed})")
