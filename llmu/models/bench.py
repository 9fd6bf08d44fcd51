"""Benchmarks of module 00: how fast the whole model loads and generates, llmu against transformers.

Loading (``model_load_s``, :func:`time_loads`): llmu's first load of a dtype dequantizes the GGUF
file and writes the weights to its cache on disk; later loads map that file
(:mod:`llmu.models.weight_cache`). transformers' ``from_pretrained`` of the same GGUF file beside them.

Generating (``decode_tokens_per_s``, :func:`compare_decode`): batch 1, a prompt of ``prompt``
tokens, exactly ``new`` greedy tokens (end-of-sequence ignored), the same float32 weights and the
same threads for both providers. One generation gives both figures, the prefill timed apart:

- prefill tokens/s = ``prompt / t_first``, ``t_first`` from the call to the first new token (the
  prompt in one forward pass, and the first pick);
- decode tokens/s = ``(new - 1) / (t_end - t_first)``: the other tokens, one forward pass each,
  each reading every weight once (memory-bound), so tokens/s is about bandwidth / model bytes.

Three providers: ``"llmu"`` (``generate_ids``, whose decode steps run through
:class:`llmu.models.decode_step.DecodeStep`), ``"llmu (modules)"`` (the same generation with every
decode step through the model's modules: what the step buys) and ``"transformers"``.
They are called in turn (``llmu, llmu (modules), transformers, llmu, ...``, ``repeats`` rounds
after a short warm-up, :func:`llmu.bench.interleave`); each row carries its median and spread,
the paired ratio ``llmu_r / transformers_r`` of every round (median, min..max, and whether that
includes 1), and the load average. Both must produce the same tokens: transformers' model is
built from llmu's weights (``to_transformers``) and its generation config has no end-of-sequence
token, so it stops after exactly ``new`` tokens as llmu does (``min_new_tokens`` would do that by
setting the end token's logit to ``-inf``, which changes what greedy decoding picks). A round in
which llmu's ids differ from transformers' makes llmu's rows errors, not speeds. The model runs in
float32 on a GPU too: two implementations of the same function round differently, and in bf16
that flips near-ties of the argmax within a few hundred tokens, so the ids could not be compared.

FLOPs per decoded token are about ``2 * parameters`` (a multiply and an add per weight); bytes
per decoded token about ``parameters * bytes_per_weight`` plus the KV cache read.
transformers is an optional provider (left out when it is not installed).
"""

from __future__ import annotations

import contextlib
import time

import torch

from llmu import runtime
from llmu.bench.paired import Paired, first_difference, interleave
from llmu.bench.registry import Entry, register

PROVIDERS = ("llmu", "llmu (modules)", "transformers")


def to_transformers(model):
    """A transformers ``LlamaForCausalLM`` holding (copies of) ``model``'s weights."""
    import transformers

    c = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        rope_theta=c.rope_theta, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
    )
    if c.rope_layout != "half":
        raise ValueError("to_transformers needs a model with rope_layout='half' (Hugging Face's)")
    hf = transformers.LlamaForCausalLM(hf_config)  # randomly initialised, then overwritten
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v.detach().clone()
             for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"weights do not fit transformers' Llama: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(model.dtype).eval()


def benchmark_copy(model):
    """:func:`to_transformers` with no end-of-sequence token in its generation config: its
    ``generate`` stops after ``max_new_tokens``, as ``llmu.models.generate_ids`` without
    ``eos_ids`` does, and picks the same tokens."""
    hf = to_transformers(model)
    hf.generation_config.eos_token_id = None
    return hf


def _prompt(vocab_size: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (1, length), generator=g)


def run_llmu(model, prompt: torch.Tensor, new_tokens: int, *, modules: bool = False) -> dict:
    """One greedy generation of exactly ``new_tokens`` by llmu after ``prompt`` (``(1, T)``):
    ``prefill_s`` (the call to the first new token), ``decode_s`` (first token to last), ``ids``
    and ``decode_path``. ``modules``: decode through the model's modules, not ``DecodeStep``."""
    from llmu.models import decode_step
    from llmu.models.generate import GenerationStats, generate_ids

    prompt_ids, ids, stats = prompt[0].tolist(), [], GenerationStats()
    with decode_step.disabled() if modules else contextlib.nullcontext():
        start = first = time.perf_counter()
        for token in generate_ids(model, prompt_ids, new_tokens, stats=stats):
            if not ids:
                first = time.perf_counter()
            ids.append(token)
        end = time.perf_counter()
    return {"prefill_s": first - start, "decode_s": end - first, "ids": ids, "decode_path": stats.decode_path}


def run_transformers(hf_model, prompt: torch.Tensor, new_tokens: int) -> dict:
    """The same as :func:`run_llmu` with transformers' ``generate`` (greedy) on a model of
    :func:`benchmark_copy`; the first new token is timed by a streamer, which ``generate`` hands
    the prompt, then each new token as soon as it is picked."""
    from transformers.generation.streamers import BaseStreamer

    if hf_model.generation_config.eos_token_id is not None:
        raise ValueError("the model's generation config has an eos_token_id: generate could stop early "
                         "(use benchmark_copy(model))")

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:  # the first call hands the prompt
                self.first = time.perf_counter()

        def end(self):
            pass

    streamer = FirstToken()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0, streamer=streamer)
    end = time.perf_counter()
    ids = out[0, prompt.shape[1]:].tolist()
    if len(ids) != new_tokens:
        raise RuntimeError(f"transformers generated {len(ids)} tokens, not {new_tokens}")
    first = streamer.first if streamer.first is not None else end
    return {"prefill_s": first - start, "decode_s": end - first, "ids": ids}


def compare_decode(model, prompt_len: int = 128, new_tokens: int = 64, repeats: int = 5, hf_model=None,
                   providers=PROVIDERS) -> Paired:
    """Prefill and decode tokens/s of each provider, called in turn for ``repeats`` rounds after a
    two-token warm-up each; ids checked against transformers' (the module's docstring).

    Each round's figures: ``decode_tokens_per_s`` (the default one) and ``prefill_tokens_per_s``;
    the output: the new token ids. ``hf_model``: a :func:`benchmark_copy` of ``model`` (made here
    when ``None``). With both providers the ratios are llmu's over transformers'.
    """
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 to time decoding, got {new_tokens}")
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown or not providers:
        raise ValueError(f"providers must be some of {PROVIDERS}, got {tuple(providers)}")
    prompt = _prompt(model.config.vocab_size, prompt_len).to(model.device)
    runs = {}
    if "llmu" in providers:
        runs["llmu"] = lambda n: run_llmu(model, prompt, n)
    if "llmu (modules)" in providers:
        runs["llmu (modules)"] = lambda n: run_llmu(model, prompt, n, modules=True)
    if "transformers" in providers:
        hf = hf_model if hf_model is not None else benchmark_copy(model)
        runs["transformers"] = lambda n: run_transformers(hf, prompt, n)
    for run in runs.values():  # warm up (first calls allocate and pick kernels)
        run(2)

    def figures(run) -> dict:
        r = run(new_tokens)
        return {"decode_tokens_per_s": (new_tokens - 1) / max(r["decode_s"], 1e-9),
                "prefill_tokens_per_s": prompt_len / max(r["prefill_s"], 1e-9), "output": r["ids"]}

    calls = {name: (lambda run=run: figures(run)) for name, run in runs.items()}
    base = "transformers" if "transformers" in calls and len(calls) > 1 else None
    return interleave(calls, repeats, warmup=0, base=base, figure="decode_tokens_per_s", check=len(calls) > 1,
                      reference=base or next(iter(calls)),
                      compare=lambda want, got: first_difference(want, got, ("token",)))


def measure(model, prompt_len: int = 128, new_tokens: int = 64, repeats: int = 5, hf_model=None,
            providers=PROVIDERS) -> dict:
    """:func:`compare_decode` as numbers per provider: ``prefill_tokens_per_s`` and
    ``decode_tokens_per_s`` (medians over the rounds), ``prefill_s`` and ``decode_s`` (the
    seconds those medians give: ``prompt_len / prefill`` and ``(new_tokens - 1) / decode``)."""
    paired = compare_decode(model, prompt_len, new_tokens, repeats, hf_model, providers)
    out = {}
    for name in paired.names:
        prefill = paired.stats(name, "prefill_tokens_per_s")["median"]
        decode = paired.stats(name, "decode_tokens_per_s")["median"]
        out[name] = {"prefill_s": prompt_len / prefill, "decode_s": (new_tokens - 1) / decode,
                     "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode}
    return out


def _run(size: dict, device) -> list[dict]:
    from llmu.models.loading import load_model

    dtype = torch.float32  # on a GPU too: the ids are compared (the module's docstring)
    model = load_model(dtype=dtype, device=device)
    providers = ["llmu", "llmu (modules)"]
    try:
        import transformers  # noqa: F401

        providers.append("transformers")
    except ImportError:
        pass
    p, n = size.get("prompt", 128), size.get("new", 64)
    paired = compare_decode(model, p, n, repeats=size.get("repeats", 5), providers=tuple(providers))
    params = model.num_parameters()
    elem = torch.empty((), dtype=dtype).element_size()
    roof = decode_roof(model, device)
    rows = []
    for provider in paired.names:
        for phase in ("prefill", "decode"):
            fields = paired.row_fields(provider, f"{phase}_tokens_per_s", key="tokens_per_s")
            row = dict(
                provider=provider, label=f"{provider} {phase}",
                kind="torch" if provider.startswith("llmu") else "external", phase=phase, **fields,
                flops=2.0 * params, bytes=float(params * elem), dtype=dtype, threads=torch.get_num_threads(),
            )
            if phase == "decode":
                row.update(roof, roof_fraction=fields["tokens_per_s"] / roof["roof_tokens_per_s"])
                if provider == "llmu" and "llmu (modules)" in paired.names:
                    row.update(_over_modules(paired))
            rows.append(row)
    return rows


def _over_modules(paired) -> dict:
    """What ``DecodeStep`` buys: llmu's decode tokens/s over the module path's, paired by round."""
    r = paired.ratio("llmu", "decode_tokens_per_s", over="llmu (modules)")
    return {"over_modules": r["median"], "over_modules_min": r["min"], "over_modules_max": r["max"]}


def decode_roof(model, device=None, budget_s: float = 1.0) -> dict:
    """The memory roof of decoding ``model`` at batch 1 here: every weight is read once per token,
    so no implementation can beat ``bandwidth / weight bytes`` tokens/s. The bandwidth is this
    machine's copy rate, measured now with torch's current threads
    (:func:`llmu.bench.machine.copy_bandwidth`, as module 05's ``measure_machine`` measures it); the
    weight bytes count a tied embedding once (the head reads it whole, the lookup one row). Returns
    ``weight_bytes_per_token``, ``bandwidth_gbs`` and ``roof_tokens_per_s``."""
    from llmu.bench.machine import copy_bandwidth

    weight_bytes = model.num_parameters() * torch.empty((), dtype=model.dtype).element_size()
    bandwidth, _, _ = copy_bandwidth(device if device is not None else model.device, budget_s=budget_s)
    return {"weight_bytes_per_token": float(weight_bytes), "bandwidth_gbs": bandwidth / 1e9,
            "roof_tokens_per_s": bandwidth / weight_bytes}


DECODE = register(
    Entry(
        name="decode_tokens_per_s",
        module="00_welcome",
        description="SmolLM2-135M generation, batch 1: prefill and decode tokens/s, llmu (DecodeStep), llmu "
                    "through its modules and transformers in turn (paired ratios, identical greedy ids enforced; "
                    "ms, flops, bytes per token)",
        run=_run,
        gpu_sizes=[{"prompt": 128, "new": 128, "repeats": 5}, {"prompt": 1024, "new": 128, "repeats": 5}],
        cpu_sizes=[{"prompt": 128, "new": 64, "repeats": 5}],
        gpu_dtype=torch.float32,
        x_axis="prompt",
    )
)


# ---------------------------------------------------------------------------------------------
# Loading the model: the first time (dequantize the GGUF file) and after (map the weight cache)
# ---------------------------------------------------------------------------------------------

LOAD_PROVIDERS = ("llmu cold", "llmu warm", "transformers")


def time_loads(dtype=torch.float32, device="cpu", *, path=None, providers=LOAD_PROVIDERS) -> dict[str, float]:
    """Seconds to load the model from the GGUF file ``path`` (the course's by default): llmu's first
    load with an empty weight cache ("llmu cold": parse, dequantize, write the cache), its next one
    ("llmu warm": hash the file, map the cache), and transformers' ``from_pretrained`` of the same file.

    The cache lives in a temporary folder for the measurement (``LLMU_CACHE`` is set meanwhile),
    and what a new process would recompute (the parsed metadata, the file's hash) is forgotten
    first, so both llmu figures are what a fresh process waits for, imports aside.
    transformers raises ``ImportError`` when it (or ``accelerate``) is not installed.
    """
    import os
    import tempfile
    from pathlib import Path

    from llmu.cache import CACHE_ENV
    from llmu.models import gguf_file, weight_cache
    from llmu.models.loading import load_weights

    unknown = set(providers) - set(LOAD_PROVIDERS)
    if unknown:
        raise ValueError(f"providers must be among {LOAD_PROVIDERS}, got {sorted(unknown)}")
    path = Path(path) if path is not None else gguf_file.model_path()
    out = {}
    if "llmu cold" in providers or "llmu warm" in providers:
        previous = os.environ.get(CACHE_ENV)
        with tempfile.TemporaryDirectory(prefix="llmu-load-bench-") as folder:
            os.environ[CACHE_ENV] = folder
            try:
                for provider in ("llmu cold", "llmu warm"):
                    gguf_file._parse.cache_clear()
                    weight_cache._sha256.cache_clear()
                    start = time.perf_counter()
                    model, _ = load_weights(path, dtype=dtype, device=device)
                    seconds = time.perf_counter() - start
                    del model
                    if provider in providers:
                        out[provider] = seconds
            finally:
                if previous is None:
                    os.environ.pop(CACHE_ENV, None)
                else:
                    os.environ[CACHE_ENV] = previous
    if "transformers" in providers:
        import accelerate  # noqa: F401 - transformers needs it to load a GGUF file
        import transformers

        start = time.perf_counter()
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        out["transformers"] = time.perf_counter() - start
        del hf
    return out


def _run_load(size: dict, device) -> list[dict]:
    dtype = runtime.preferred_dtype(device)
    seconds = time_loads(dtype, device, providers=("llmu cold", "llmu warm"))
    skipped = {}
    try:
        seconds.update(time_loads(dtype, device, providers=("transformers",)))
    except ImportError as exc:  # transformers or accelerate missing: skipped, as the runner does for providers
        skipped["transformers"] = f"not installed: {type(exc).__name__}: {exc}"
    rows = []
    for provider in LOAD_PROVIDERS:
        row = dict(provider=provider, label=provider, kind="external" if provider == "transformers" else "torch",
                   dtype=dtype)
        if provider in skipped:
            row.update(status="skipped", reason=skipped[provider])
        else:
            row.update(ms=1e3 * seconds[provider], seconds=seconds[provider])
        rows.append(row)
    return rows


LOAD = register(
    Entry(
        name="model_load_s",
        module="00_welcome",
        description="Loading SmolLM2-135M: llmu's first load (dequantize the GGUF file, write the weight "
                    "cache), its next ones (map the cache), and transformers' load of the same GGUF file",
        run=_run_load,
    )
)
