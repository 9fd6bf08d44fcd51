"""Benchmark entries of module 16: what each part of the serving engine buys, measured in one run.

``serving_throughput`` (a whole-model ``run=`` entry): ``requests`` requests with prompts of
varied length (uniform in ``[prompt_min, prompt_max]`` tokens), request ``i`` asking for exactly
``new_i`` greedy tokens, uniform in ``[new_min, new]`` (end-of-sequence ignored, so every
configuration does the same work; ``new_min`` defaults to ``new``: all alike). Generated
tokens per second of wall time, for:

- ``transformers sequential``: Hugging Face ``generate``, one request after the other (the usual
  baseline);
- ``llmu sequential``: ``llmu.models.generate``, one request after the other;
- ``static batching``: the engine forming batches of ``batch`` requests, nobody joining a batch
  until all its members are done;
- ``continuous, contiguous KV``: continuous batching, but each request reserves the whole
  ``max_model_len`` up front, as a cache preallocated per sequence does, in the same KV memory;
- ``continuous, paged KV``: continuous batching with blocks allocated as sequences grow;
- with ``shared_prefix > 0`` every prompt starts with the same ``shared_prefix`` tokens (a system
  prompt), and two more rows compare the paged engine without and with prefix caching.

The sequential providers run on the first ``sequential`` requests only (a rate, tokens/s, does
not need all of them, and one at a time is slow). The KV memory is ``kv_seqs * max_model_len``
positions for every engine row, plus the one block the scheduler keeps spare for copy-on-write. Each row's ``speedup`` is its tokens/s over the transformers
row's (over llmu sequential's when transformers is not installed); ``kv_waste`` is the fraction of
allocated KV positions that held nothing, averaged over the engine's steps.
"""

from __future__ import annotations

import importlib.util
import time

import torch

from llmu import runtime
from llmu.bench.registry import Entry, register
from llmu.engine.engine import LLMEngine
from llmu.engine.sequence import SamplingParams

__all__ = ["serving_workload", "measure_serving", "SERVING"]


def serving_workload(vocab_size: int, requests: int = 32, prompt_min: int = 16, prompt_max: int = 256,
                     shared_prefix: int = 0, seed: int = 0) -> list[list[int]]:
    """``requests`` prompts of token ids (random ids from the vocabulary's ordinary range)."""
    if requests < 1 or not 1 <= prompt_min <= prompt_max:
        raise ValueError(f"need requests >= 1 and 1 <= prompt_min <= prompt_max, got {requests}, "
                         f"{prompt_min}, {prompt_max}")
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(100, vocab_size, (shared_prefix,), generator=g).tolist()
    lens = torch.randint(prompt_min, prompt_max + 1, (requests,), generator=g).tolist()
    return [prefix + torch.randint(100, vocab_size, (n,), generator=g).tolist() for n in lens]


def _engine_run(model, prompts, new, **kw) -> dict:
    """``new``: tokens per request (an int for all, or one per prompt)."""
    engine = LLMEngine(model, None, **kw)
    news = [new] * len(prompts) if isinstance(new, int) else list(new)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in news]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    s = engine.stats
    return dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, steps=s.steps,
                kv_waste=s.kv_waste, peak_running=s.peak_running, preemptions=s.preemptions,
                prefix_cached_tokens=s.prefix_cached_tokens, outputs=[o.outputs[0].token_ids for o in outs])


def _sequential_llmu(model, prompts, new) -> dict:
    from llmu.models.generate import generate_ids

    start = time.perf_counter()
    outputs = [list(generate_ids(model, p, n)) for p, n in zip(prompts, new)]
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    return dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, outputs=outputs)


def _sequential_transformers(hf, prompts, new) -> dict:
    from llmu.models.bench import time_transformers

    seconds = sum(time_transformers(hf, torch.tensor([p]), n) for p, n in zip(prompts, new))
    tokens = sum(new[: len(prompts)])
    return dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds)


def measure_serving(model, *, requests: int = 32, new: int = 32, new_min: int | None = None, prompt_min: int = 16,
                    prompt_max: int = 256, batch: int = 8, kv_seqs: int = 8, max_model_len: int = 512,
                    sequential: int = 8, shared_prefix: int = 0, transformers: bool | None = None,
                    seed: int = 0) -> dict[str, dict]:
    """Tokens/s of every configuration on one workload (see the module docstring), in one run."""
    prompts = serving_workload(model.config.vocab_size, requests, prompt_min, prompt_max, shared_prefix, seed)
    new_min = new if new_min is None else new_min
    if not 1 <= new_min <= new:
        raise ValueError(f"need 1 <= new_min <= new, got new_min={new_min}, new={new}")
    g = torch.Generator().manual_seed(seed + 1)
    news = torch.randint(new_min, new + 1, (requests,), generator=g).tolist()
    if max(len(p) for p in prompts) + new > max_model_len:
        raise ValueError(f"max_model_len ({max_model_len}) is shorter than the longest prompt plus new tokens")
    num_blocks = kv_seqs * -(-max_model_len // 16) + 1
    common = dict(num_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=requests)
    results: dict[str, dict] = {}
    if transformers is None:  # an optional provider: only where the test extra is installed
        transformers = importlib.util.find_spec("transformers") is not None
    # warm up once: the first forward passes allocate and pick kernels
    _engine_run(model, prompts[:2], 2, num_blocks=num_blocks, max_model_len=max_model_len)
    if transformers:
        from llmu.models.bench import to_transformers

        hf = to_transformers(model)
        _sequential_transformers(hf, prompts[:1], [2])
        results["transformers sequential"] = _sequential_transformers(hf, prompts[:sequential], news)
        del hf
    results["llmu sequential"] = _sequential_llmu(model, prompts[:sequential], news)
    results["static batching"] = _engine_run(model, prompts, news, **dict(common, max_num_seqs=batch),
                                             policy="static", prefix_caching=False)
    results["continuous, contiguous KV"] = _engine_run(model, prompts, news, **common, reserve="context",
                                                       prefix_caching=False)
    results["continuous, paged KV"] = _engine_run(model, prompts, news, **common, prefix_caching=False)
    if shared_prefix:
        results["paged + prefix caching"] = _engine_run(model, prompts, news, **common, prefix_caching=True)
    base = results.get("transformers sequential", results["llmu sequential"])["tokens_per_s"]
    for r in results.values():
        r["speedup"] = r["tokens_per_s"] / base
    return results


def _run(size: dict, device) -> list[dict]:
    from llmu.models.loading import load_model

    dtype = runtime.preferred_dtype(device)  # float32 on a CPU, bf16 on an A100/H100, fp16 on a T4
    model = load_model(dtype=dtype, device=device)
    keys = ("requests", "new", "new_min", "prompt_min", "prompt_max", "batch", "kv_seqs", "max_model_len", "sequential",
            "shared_prefix")
    res = measure_serving(model, **{k: size[k] for k in keys if k in size})
    params = model.num_parameters()
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for name, r in res.items():
        rows.append(dict(
            provider=name, label=name, kind="external" if name.startswith("transformers") else "torch",
            tokens_per_s=r["tokens_per_s"], ms=1e3 / r["tokens_per_s"], speedup=r["speedup"],
            kv_waste=r.get("kv_waste", float("nan")), peak_running=r.get("peak_running", 1),
            flops=2.0 * params, bytes=float(params * elem), dtype=dtype,
        ))
    return rows


SERVING = register(
    Entry(
        name="serving_throughput",
        module="16_serving_engine",
        description="SmolLM2-135M serving 32 requests: tokens/s of sequential generate, static batching, "
                    "continuous batching with a contiguous or a paged KV cache, prefix caching (speedup over "
                    "sequential transformers generate)",
        run=_run,
        gpu_sizes=[{"requests": 256, "new": 128, "new_min": 16, "prompt_max": 1024, "max_model_len": 2048, "kv_seqs": 64,
                    "batch": 32, "sequential": 4, "shared_prefix": 256}],
        cpu_sizes=[{"requests": 32, "new": 64, "new_min": 16, "prompt_max": 128, "max_model_len": 256,
                    "kv_seqs": 16, "batch": 8, "sequential": 8, "shared_prefix": 32}],
        x_axis="requests",
    )
)
