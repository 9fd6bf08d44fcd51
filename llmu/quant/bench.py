"""Benchmark of module 10: does int8 weight-only quantization make decoding faster?

``int8_decode`` (a whole-model ``run=`` entry, :func:`compare_decode`): SmolLM2-135M, batch 1,
greedy decode tokens/s with the projections of the blocks in floating point against the same
model with them quantized to 8-bit symmetric per-channel weights (``quantize_model(model, bits=8,
symmetric=True, granularity="channel")``). The two models run in turn (``float, int8, float,
...``, ``repeats`` rounds after a two-token warm-up each, :func:`llmu.bench.interleave`); each
run generates exactly ``new`` tokens after a prompt of ``prompt`` tokens, and its decode tokens/s
leaves the prefill out: ``(new - 1) / (t_end - t_first)``, ``t_first`` the time of the first new
token (as ``decode_tokens_per_s`` of module 00 times it).

Decoding one token reads every weight once and does two FLOPs per weight: at batch 1 it is
memory-bound, so tokens/s should follow the bytes of the weights — int8 moves a quarter of
float32's bytes and half of bf16's. Whether it does depends on the matmul reading the int8 codes
*directly*: ``QuantLinear`` uses PyTorch's ``aten._weight_int8pack_mm`` for bf16/fp16 activations
(fast on CPU and GPU), and a cast-then-matmul for float32 activations: it reads one byte per
weight from memory but writes and reads a float32 copy of the matrix on every call, which costs
little while the copy stays in the CPU's caches (SmolLM2's matrices are at most 3.5 MB in
float32) and a lot once it does not. The rows say which path ran.

Rows (``provider``): on a CPU ``fp32``, ``int8 (fp32 activations)``, ``bf16``, ``int8 (bf16
activations)``; on a GPU the bf16 pair. ``ratio``: the median of the per-round ratios of
tokens/s over the float model with the same activation dtype (with its min..max, whether that
includes 1, and the load average); ``ratio_vs_fp32`` (CPU): the median tokens/s over the fp32
model's, which ran in another pair (one pair at a time: two models in memory, never four), so it
is a ratio of medians, not a paired one. The outputs are not compared: int8 weights change the
function, so their greedy tokens part from the float model's sooner or later. FLOPs per token
``2 * P`` (P parameters, the LM head included), bytes per token the weights as stored
(``model_nbytes``).
"""

from __future__ import annotations

import torch

from llmu import runtime
from llmu.bench.paired import Paired, interleave
from llmu.bench.registry import Entry, register

__all__ = ["INT8_DECODE", "compare_decode", "measure_decode", "int8_model"]


def int8_model(model):
    """An int8 weight-only copy of ``model`` (symmetric, one scale per output channel)."""
    from llmu.quant.apply import quantize_model

    return quantize_model(model, "rtn", bits=8, symmetric=True, granularity="channel")


def compare_decode(models: dict, prompt_len: int = 32, new_tokens: int = 17, repeats: int = 3,
                   seed: int = 0) -> Paired:
    """Decode tokens/s of each model (name -> model), batch 1, greedy, in turn, ``repeats`` rounds.

    Figure ``decode_tokens_per_s``: ``(new_tokens - 1) / (t_end - t_first)``, the prefill left out;
    output: the new ids (kept, not compared). Ratios are over the first model.
    """
    from llmu.models.bench import _prompt, run_llmu

    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 to time decoding, got {new_tokens}")
    if not models:
        raise ValueError("models is empty")
    vocab = min(m.config.vocab_size for m in models.values())
    prompt = _prompt(vocab, prompt_len, seed)
    for model in models.values():  # warm up (first calls allocate and pick kernels)
        run_llmu(model, prompt.to(model.device), 2)

    def call(model):
        def one_run() -> dict:
            r = run_llmu(model, prompt.to(model.device), new_tokens)
            return {"decode_tokens_per_s": (new_tokens - 1) / max(r["decode_s"], 1e-9), "output": r["ids"]}
        return one_run

    return interleave({name: call(model) for name, model in models.items()}, repeats, warmup=0,
                      base=next(iter(models)))


def measure_decode(models: dict, prompt_len: int = 32, new_tokens: int = 17, repeats: int = 3,
                   seed: int = 0) -> dict[str, float]:
    """:func:`compare_decode`'s median decode tokens/s of each model (name -> tokens/s)."""
    paired = compare_decode(models, prompt_len, new_tokens, repeats, seed)
    return {name: paired.stats(name)["median"] for name in paired.names}


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
        paired = compare_decode({name: base, qname: quant}, size.get("prompt", 32), size.get("new", 64),
                                size.get("repeats", 3))
        if dtype == torch.float32:
            fp32_tps = paired.stats(name)["median"]
        params = base.num_parameters()
        for provider, model in ((name, base), (qname, quant)):
            fields = paired.row_fields(provider, key="tokens_per_s")
            rows.append(dict(
                provider=provider, label=f"{provider} decode", kind="torch", phase="decode", **fields,
                ratio_vs_fp32=None if fp32_tps is None else fields["tokens_per_s"] / fp32_tps,
                flops=2.0 * params, bytes=float(model_nbytes(model)), dtype=dtype, path=_path(model),
            ))
        del base, quant  # before the next dtype's pair is loaded: two models in memory, never four
    return rows


INT8_DECODE = register(
    Entry(
        name="int8_decode",
        module="10_quantization",
        description="SmolLM2-135M decode tokens/s at batch 1: float weights vs int8 weight-only (torch path), "
                    "in turn, with the paired ratio",
        run=_run,
        gpu_sizes=[{"prompt": 128, "new": 128, "repeats": 5}],
        cpu_sizes=[{"prompt": 32, "new": 64, "repeats": 3}],
        x_axis="prompt",
    )
)

try:  # the Triton kernels' entries (int4_gemv, int4_gemm, int8_gemv), when that module is there
    from llmu.quant import bench_kernels  # noqa: F401
except ModuleNotFoundError as exc:
    if exc.name != "llmu.quant.bench_kernels":
        raise
