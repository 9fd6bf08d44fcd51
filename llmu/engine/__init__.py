"""Module 16: a small serving engine built from the course's parts.

- ``llmu.engine.sequence``: a request's tokens, counters and sampling parameters;
- ``llmu.engine.scheduler``: continuous (or static) batching with a token budget, admission by free
  blocks, chunked prefill, preemption by recomputation;
- ``llmu.engine.model_runner``: one packed forward pass over the paged cache, then sampling;
- ``llmu.engine.engine``: ``LLMEngine.generate`` / ``stream`` / ``step``;
- ``llmu.engine.timeline``: a run written down step by step (or simulated without the model), and its pictures;
- ``llmu.engine.chat``: ``llmu chat``, a streaming chat with the course's model;
- ``llmu.engine.bench``: throughput against sequential generation and static batching.

>>> from llmu.engine import LLMEngine, SamplingParams
>>> engine = LLMEngine(model, tokenizer)
>>> [o.text for o in engine.generate(["Hi!", "What is 2+2?"], SamplingParams(max_tokens=32))]

The notebook is ``solutions/16_serving_engine/16_serving_engine.ipynb``.
"""

from __future__ import annotations

from llmu.engine.engine import DEFAULT_KV_BYTES, CompletionOutput, EngineStats, LLMEngine, RequestOutput, StreamEvent
from llmu.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from llmu.engine.sequence import SamplingParams, Sequence, Status

__all__ = ["LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamEvent", "EngineStats",
           "Scheduler", "SchedulerConfig", "ScheduledBatch", "Sequence", "Status", "DEFAULT_KV_BYTES"]
