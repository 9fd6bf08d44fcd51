"""Benchmark of module 10: does int8 weight-only quantization make decoding faster?

``int8_decode`` (a whole-model ``run=`` entry): SmolLM2-135M, batch 1, greedy decode tokens/s with
the projections of the blocks in floating point against the same model with them quantized to
8-bit symmetric per-channel weights (``quantize_model(model, bits=8, symmetric=True,
granularity="channel")``), timed side by side (interleaved runs, median of ``repeats``).

Decoding one token reads every weight once and does two FLOPs per weight: at batch 1 it is
memory-bound, so tokens/s should follow the bytes of the weights — int8 moves a quarter of
float32's bytes and half of bf16's. Whether it does depends on the matmul reading the int8 codes
*directly*: ``QuantLinear`` uses PyTorch's ``aten._weight_int8pack_mm`` for bf16/fp16 activations
(fast on CPU and GPU), and a cast-then-matmul for float32 activations: it reads one byte per
weight from memory but writes and reads a float32 copy of the matrix on every call, which costs
little while the copy stays in the CPU's caches (SmolLM2's matrices are at most 3.5 MB in
float32) and a lot once it does not. The rows say which path ran.

Rows (``provider``): on a CPU ``fp32``, ``int8 (fp32 activations)``, ``bf16``, ``int8 (bf16
activations)``; on a GPU the bf16 pair. ``ratio``: tokens/s over the float model with the same
activation dtype; ``ratio_vs_fp32``: over the fp32 model (CPU). FLOPs per token ``2 * P`` (P
parameters, the LM head included), bytes per token the weights as stored (``model_nbytes``).
"""

from __future__ import annotations

import statistics

import torch

from llmu import runtime
from llmu.bench.registry import Entry, register

__all__ = ["INT8_DECODE", "measure_decode", "int8_model"]


def int8_model(model):
    """An int8 weight-only copy of ``model`` (symmetric, one scale per output channel)."""
    from llmu.quant.apply import quantize_model

    return quantize_model(model, "rtn", bits=8, symmetric=True, granularity="channel")


def measure_decode(models: dict, prompt_len: int = 32, new_tokens: int = 17, repeats: int = 3,
                   seed: int = 0) -> dict[str, float]:
    """Decode tokens/s of each model (name -> model), batch 1, greedy, runs interleaved.

    Decode time = ``t(new_tokens) - t(1)`` (the first token costs the prefill), over
    ``new_tokens - 1`` tokens; the median of ``repeats`` runs.
    """
    from llmu.models.bench import _prompt, time_llmu

    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 to time decoding, got {new_tokens}")
    if not models:
        raise ValueError("models is empty")
    vocab = min(m.config.vocab_size for m in models.values())
    prompt = _prompt(vocab, prompt_len, seed)
    for model in models.values():  # warm up (first calls allocate and pick kernels)
        time_llmu(model, prompt.to(model.device), 2)
    samples = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():  # interleaved: a busy moment hurts all alike
            p = prompt.to(model.device)
            one = time_llmu(model, p, 1)
            full = time_llmu(model, p, new_tokens)
            samples[name].append(max(full - one, 1e-9))
    return {name: (new_tokens - 1) / statistics.median(s) for name, s in samples.items()}


def _path(model) -> str:
    from llmu.quant.apply import quantized_layers

    paths = {m.last_path for m in quantized_layers(model).values()}
    return ", ".join(sorted(p for p in paths if p)) or "float"


def _run(size: dict, device) -> list[dict]:
    from llmu.models.loading import load_model
    from llmu.quant.apply import model_nbytes

    cpu = torch.device(device).type == "cpu"
    half = runtime.half_dtype(device)  # bf16, or fp16 on a GPU without bf16 (a T4)
    dtypes = (torch.float32, half) if cpu else (half,)
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    rows, fp32_tps = [], None
    for dtype in dtypes:  # one pair at a time: only two models in memory
        base = load_model(dtype=dtype, device=device)
        quant = int8_model(base)
        name, qname = names[dtype], f"int8 ({names[dtype]} activations)"
        tps = measure_decode({name: base, qname: quant}, size.get("prompt", 32), size.get("new", 17),
                             size.get("repeats", 3))
        if dtype == torch.float32:
            fp32_tps = tps[name]
        params = base.num_parameters()
        for provider, model in ((name, base), (qname, quant)):
            rows.append(dict(
                provider=provider, label=f"{provider} decode", kind="torch", phase="decode",
                tokens_per_s=tps[provider], ms=1e3 / tps[provider], ratio=tps[provider] / tps[name],
                ratio_vs_fp32=None if fp32_tps is None else tps[provider] / fp32_tps,
                flops=2.0 * params, bytes=float(model_nbytes(model)), dtype=dtype, path=_path(model),
            ))
        del base, quant  # before the next dtype's pair is loaded: two models in memory, never four
    return rows


INT8_DECODE = register(
    Entry(
        name="int8_decode",
        module="10_quantization",
        description="SmolLM2-135M decode tokens/s at batch 1: float weights vs int8 weight-only (torch path), "
                    "side by side, with the ratio",
        run=_run,
        gpu_sizes=[{"prompt": 128, "new": 128}],
        cpu_sizes=[{"prompt": 32, "new": 17, "repeats": 3}],
        x_axis="prompt",
    )
)

try:  # the Triton kernels' entries (int4_gemv, int4_gemm, int8_gemv), when that module is there
    from llmu.quant import bench_kernels  # noqa: F401
except ModuleNotFoundError as exc:
    if exc.name != "llmu.quant.bench_kernels":
        raise
