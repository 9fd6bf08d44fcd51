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
positions for every engine row, plus the one block the scheduler keeps spare for copy-on-write.

Every configuration runs once per round, all of them in turn, for ``repeats`` rounds
(:func:`llmu.bench.interleave`), after a two-token warm-up: a change of the machine's load hits
them all alike. Each row's ``tokens_per_s`` is its median over the rounds, and its ``ratio`` (and
``speedup``, the same number) the median of the per-round ratios ``tokens/s_r / base_r`` over the
transformers row (over llmu sequential's when transformers is not installed), with their
min..max, whether that includes 1, and the load average. Every configuration must produce the
same tokens: each request's ids are compared with the paged engine's in every round (the
sequential rows on their requests), and a configuration that differs is an error row, with the
request and token where it did. The model runs in float32 on a GPU too, for that comparison:
batches of other shapes round differently, and in bf16 that flips near-ties of the argmax.
``kv_waste`` is the fraction of allocated KV positions that held nothing, averaged over the
engine's steps.

``engine_batch1`` (:func:`compare_batch1`): one request, the engine against plain ``generate``,
in turn round after round, ids compared: at batch 1 the engine should cost nothing measurable.
"""

from __future__ import annotations

import importlib.util
import time

import torch

from llmu.bench.paired import Paired, first_difference, interleave
from llmu.bench.registry import Entry, register
from llmu.engine.engine import LLMEngine
from llmu.engine.sequence import SamplingParams

__all__ = ["serving_workload", "compare_serving", "measure_serving", "compare_batch1", "SERVING", "ENGINE_BATCH1"]

#: The configuration whose outputs every other one is compared with.
REFERENCE = "continuous, paged KV"


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
    return dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
                info=dict(steps=s.steps, kv_waste=s.kv_waste, peak_running=s.peak_running,
                          preemptions=s.preemptions, prefix_cached_tokens=s.prefix_cached_tokens),
                output=[list(o.outputs[0].token_ids) for o in outs])


def _sequential_llmu(model, prompts, new) -> dict:
    from llmu.models.generate import generate_ids

    start = time.perf_counter()
    outputs = [list(generate_ids(model, p, n)) for p, n in zip(prompts, new)]
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    return dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, output=outputs)


def _sequential_transformers(hf, prompts, new) -> dict:
    from llmu.models.bench import run_transformers

    start = time.perf_counter()
    outputs = [run_transformers(hf, torch.tensor([p], device=hf.device), n)["ids"] for p, n in zip(prompts, new)]
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    return dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, output=outputs)


def compare_serving(model, *, requests: int = 32, new: int = 32, new_min: int | None = None, prompt_min: int = 16,
                    prompt_max: int = 256, batch: int = 8, kv_seqs: int = 8, max_model_len: int = 512,
                    sequential: int = 8, shared_prefix: int = 0, transformers: bool | None = None,
                    seed: int = 0, repeats: int = 1) -> Paired:
    """Every configuration of the module's docstring on one workload, in turn, ``repeats`` rounds.

    Figures of each call: ``tokens_per_s`` (the default one), ``tokens`` and ``seconds``; output:
    the generated ids of each request it served; ``info`` (engine rows): ``steps``, ``kv_waste``,
    ``peak_running``, ``preemptions``, ``prefix_cached_tokens``. Ratios are over the transformers
    row (llmu sequential's without transformers); outputs are checked against the paged engine's.
    """
    prompts = serving_workload(model.config.vocab_size, requests, prompt_min, prompt_max, shared_prefix, seed)
    new_min = new if new_min is None else new_min
    if not 1 <= new_min <= new:
        raise ValueError(f"need 1 <= new_min <= new, got new_min={new_min}, new={new}")
    if sequential < 1:
        raise ValueError(f"sequential must be >= 1, got {sequential}")
    g = torch.Generator().manual_seed(seed + 1)
    news = torch.randint(new_min, new + 1, (requests,), generator=g).tolist()
    if max(len(p) for p in prompts) + new > max_model_len:
        raise ValueError(f"max_model_len ({max_model_len}) is shorter than the longest prompt plus new tokens")
    num_blocks = kv_seqs * -(-max_model_len // 16) + 1
    common = dict(num_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=requests)
    if transformers is None:  # an optional provider: only where the test extra is installed
        transformers = importlib.util.find_spec("transformers") is not None
    # warm up once: the first forward passes allocate and pick kernels
    _engine_run(model, prompts[:2], 2, num_blocks=num_blocks, max_model_len=max_model_len)
    calls = {}
    if transformers:
        from llmu.models.bench import benchmark_copy

        hf = benchmark_copy(model)
        _sequential_transformers(hf, prompts[:1], [2])
        calls["transformers sequential"] = lambda: _sequential_transformers(hf, prompts[:sequential], news)
    calls["llmu sequential"] = lambda: _sequential_llmu(model, prompts[:sequential], news)
    calls["static batching"] = lambda: _engine_run(model, prompts, news, **dict(common, max_num_seqs=batch),
                                                   policy="static", prefix_caching=False)
    calls["continuous, contiguous KV"] = lambda: _engine_run(model, prompts, news, **common, reserve="context",
                                                             prefix_caching=False)
    calls[REFERENCE] = lambda: _engine_run(model, prompts, news, **common, prefix_caching=False)
    if shared_prefix:
        calls["paged + prefix caching"] = lambda: _engine_run(model, prompts, news, **common, prefix_caching=True)
    served = len(prompts[:sequential])

    def same_ids(want, got) -> str | None:  # a sequential row answers the first `served` requests
        if len(got) not in (len(want), served):
            return f"{len(got)} requests answered, not {len(want)}"
        return first_difference(want[:len(got)], got, ("request", "token"))

    base = "transformers sequential" if transformers else "llmu sequential"
    return interleave(calls, repeats, warmup=0, base=base, figure="tokens_per_s", check=True, reference=REFERENCE,
                      compare=same_ids)


def measure_serving(model, *, requests: int = 32, new: int = 32, new_min: int | None = None, prompt_min: int = 16,
                    prompt_max: int = 256, batch: int = 8, kv_seqs: int = 8, max_model_len: int = 512,
                    sequential: int = 8, shared_prefix: int = 0, transformers: bool | None = None,
                    seed: int = 0, repeats: int = 1) -> dict[str, dict]:
    """:func:`compare_serving` as one dict per configuration: ``tokens``, ``seconds`` and
    ``tokens_per_s`` (medians), ``speedup`` (the median paired ratio; 1 for the base), ``outputs``
    (the last round's ids), the engine counters of ``info``, and ``mismatch`` (why its ids
    differ from the paged engine's, or ``None``)."""
    paired = compare_serving(model, requests=requests, new=new, new_min=new_min, prompt_min=prompt_min,
                             prompt_max=prompt_max, batch=batch, kv_seqs=kv_seqs, max_model_len=max_model_len,
                             sequential=sequential, shared_prefix=shared_prefix, transformers=transformers,
                             seed=seed, repeats=repeats)
    results = {}
    for name in paired.names:
        ratio = paired.ratio(name)
        results[name] = dict(
            tokens=int(paired.stats(name, "tokens")["median"]), seconds=paired.stats(name, "seconds")["median"],
            tokens_per_s=paired.stats(name)["median"], speedup=1.0 if ratio is None else ratio["median"],
            outputs=paired.outputs[name][-1], mismatch=paired.mismatches.get(name), **(paired.info[name][-1] or {}))
    return results


def _run(size: dict, device) -> list[dict]:
    from llmu.models.loading import load_model

    dtype = torch.float32  # on a GPU too: every configuration's ids are compared (the module's docstring)
    model = load_model(dtype=dtype, device=device)
    keys = ("requests", "new", "new_min", "prompt_min", "prompt_max", "batch", "kv_seqs", "max_model_len", "sequential",
            "shared_prefix", "repeats")
    paired = compare_serving(model, **{k: size[k] for k in keys if k in size})
    params = model.num_parameters()
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for name in paired.names:
        fields = paired.row_fields(name, "tokens_per_s", key="tokens_per_s")
        info = paired.info[name][-1] or {}
        rows.append(dict(
            provider=name, label=name, kind="external" if name.startswith("transformers") else "torch",
            **fields, kv_waste=info.get("kv_waste", float("nan")), peak_running=info.get("peak_running", 1),
            steps=info.get("steps"), preemptions=info.get("preemptions"),
            prefix_cached_tokens=info.get("prefix_cached_tokens"),
            tokens=int(paired.stats(name, "tokens")["median"]),
            flops=2.0 * params, bytes=float(params * elem), dtype=dtype,
        ))
    return rows


def compare_batch1(model, *, prompt: int = 128, new: int = 64, repeats: int = 5, seed: int = 1) -> Paired:
    """The engine serving a single request against ``llmu.models.generate`` on the same prompt,
    in turn for ``repeats`` rounds after a warm-up round; ratio engine / generate of tokens/s, ids
    compared. At batch 1 the engine can batch nothing: what it adds to each step (packing the
    step's inputs, the scheduler, attention through block tables) is its whole cost, and it
    should cost nothing measurable. The paged cache builds a step's decode index once for all
    layers and reads a lone sequence's consecutive blocks in place (``llmu.paged.cache.DecodeIndex``).
    """
    prompts = serving_workload(model.config.vocab_size, 1, prompt, prompt, seed=seed)
    num_blocks = -(-(prompt + new) // 16) + 1
    calls = {"engine, batch 1": lambda: _engine_run(model, prompts, new, num_blocks=num_blocks,
                                                    max_model_len=prompt + new, prefix_caching=False),
             "llmu generate": lambda: _sequential_llmu(model, prompts, [new])}
    return interleave(calls, repeats, warmup=1, base="llmu generate", figure="tokens_per_s", check=True,
                      reference="llmu generate",
                      compare=lambda want, got: first_difference(want[0], got[0], ("token",)))


def _run_batch1(size: dict, device) -> list[dict]:
    from llmu.models.loading import load_model

    dtype = torch.float32  # as serving_throughput: the two must give the same ids
    model = load_model(dtype=dtype, device=device)
    paired = compare_batch1(model, **{k: size[k] for k in ("prompt", "new", "repeats") if k in size})
    params = model.num_parameters()
    rows = []
    for name in paired.names:
        fields = paired.row_fields(name, "tokens_per_s", key="tokens_per_s")
        rows.append(dict(provider=name, label=name, kind="torch", **fields, flops=2.0 * params, bytes=float(params * dtype.itemsize), dtype=dtype))
    return rows


ENGINE_BATCH1 = register(
    Entry(
        name="engine_batch1",
        module="16_serving_engine",
        description="SmolLM2-135M, one request: the engine's decode tokens/s over plain generate's "
                    "(paired ratio; identical ids enforced)",
        run=_run_batch1,
        gpu_sizes=[{"prompt": 128, "new": 128, "repeats": 5}],
        cpu_sizes=[{"prompt": 128, "new": 64, "repeats": 5}],
        gpu_dtype=torch.float32,
        x_axis="prompt",
    )
)


SERVING = register(
    Entry(
        name="serving_throughput",
        module="16_serving_engine",
        description="SmolLM2-135M serving 32 requests: tokens/s of sequential generate, static batching, "
                    "continuous batching with a contiguous or a paged KV cache, prefix caching, all in turn "
                    "(paired speedup over sequential transformers generate; identical ids enforced)",
        run=_run,
        gpu_sizes=[{"requests": 256, "new": 128, "new_min": 16, "prompt_max": 1024, "max_model_len": 2048, "kv_seqs": 64,
                    "batch": 32, "sequential": 4, "shared_prefix": 256, "repeats": 3}],
        cpu_sizes=[{"requests": 32, "new": 64, "new_min": 16, "prompt_max": 128, "max_model_len": 256,
                    "kv_seqs": 16, "batch": 8, "sequential": 4, "shared_prefix": 32, "repeats": 3}],
        gpu_dtype=torch.float32,
        x_axis="requests",
    )
)
