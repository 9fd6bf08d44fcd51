"""Benchmark entries of module 03: RMSNorm, RoPE and the SwiGLU gate (forward and backward).

All five are memory-bound: a handful of floating-point operations per element against several
bytes moved, so the number that matters is GB/s against the device's bandwidth, not TFLOP/s.
``elem`` is the activations' element size (2 for bf16, 4 for fp32). The byte counts are the ideal
traffic, one read of each input and one write of each output; an implementation that makes
temporaries (the torch references do) moves more and shows it as a lower effective GB/s.

RMSNorm forward, ``M`` rows of ``N``: per element a square, an add into the sum, the multiply by
``1/rms`` and the one by the gain: ``4·M·N`` flops (the per-row root is negligible). Bytes: read
``x``, write ``y``, read the gain once: ``(2·M·N + N)·elem``.

RMSNorm backward: per element ``g = dy·w``, ``x̂ = x·r``, ``g·x̂`` into a sum, ``(g − x̂·c)·r``
(three ops) and ``dy·x̂`` into ``dw`` (two): ``9·M·N`` flops. Bytes: read ``x`` and ``dy``, write
``dx``, read the gain and write ``dw`` once: ``(3·M·N + 2·N)·elem`` (the fp32 partial sums of ``dw``
are ``programs·N·4`` bytes, small next to that, and not counted).

RoPE, ``B`` sequences of ``T`` tokens, ``Hq`` query and ``Hk`` key heads of ``D``: each pair costs
four multiplies and two adds, 3 flops per element: ``3·B·T·(Hq+Hk)·D``. Bytes: read and write q and
k once (in place) plus the fp32 ``cos`` and ``sin`` tables, ``T·D/2`` each:
``2·B·T·(Hq+Hk)·D·elem + T·D·4``.

SwiGLU gate, ``M`` rows of ``N``: per element a sigmoid (exp, add, reciprocal: counted as 3), the
multiply by ``g`` and the one by ``up``: ``5·M·N``. Bytes: read ``gate`` and ``up``, write
``y``: ``3·M·N·elem``. Backward: recompute the sigmoid (3), ``silu`` (1), ``1 + g(1−s)`` (3),
``dy·up·s·(…)`` (3) and ``dy·silu`` (1): ``11·M·N`` flops; bytes: read ``dy``, ``gate``, ``up``,
write ``d_gate``, ``d_up``: ``5·M·N·elem``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.bench.registry import Entry, Provider, register
from llmu.layers import reference
from llmu.layers.rmsnorm import rms_norm, rms_norm_backward
from llmu.layers.rope import rope
from llmu.layers.swiglu import swiglu_backward, swiglu_fused

EPS = 1e-5


def _randn(shape, g, device, dtype):
    return torch.randn(shape, generator=g, dtype=torch.float32, device="cpu").to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------- RMSNorm

def _rms_setup(size, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = _randn((size["M"], size["N"]), g, device, dtype)
    w = (torch.rand(size["N"], generator=g, device="cpu") + 0.5).to(device=device, dtype=dtype)
    return x, w


def _rms_bwd_setup(size, device, dtype):
    """Inputs for the backward pass: x and w (with grad, for autograd), the forward's output, dy, rstd."""
    x, w = _rms_setup(size, device, dtype)
    dy = _randn((size["M"], size["N"]), torch.Generator(device="cpu").manual_seed(1), device, dtype)
    # The forward's saved 1/rms, computed in torch (no kernel launch when the triton provider is skipped).
    rstd = torch.rsqrt(x.float().pow(2).mean(dim=-1) + EPS)
    x_req, w_req = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y_ref = reference.rms_norm(x_req, w_req, EPS)
    y_builtin = F.rms_norm(x_req, (size["N"],), w_req, EPS)
    return x, w, dy, rstd, x_req, w_req, y_ref, y_builtin


RMS_SIZES_GPU = [{"M": 4096, "N": n} for n in (576, 1024, 2048, 4096, 8192, 16384)]
RMS_SIZES_CPU = [{"M": 256, "N": n} for n in (576, 1536, 4096)]

RMS_NORM = register(
    Entry(
        name="rms_norm",
        module="03_rope_swiglu_rmsnorm",
        description="RMSNorm forward over M rows of N (x / rms(x) * w)",
        providers={
            "llmu triton": Provider(lambda x, w: rms_norm(x, w, EPS), "triton", "llmu Triton rms_norm"),
            "llmu torch": Provider(lambda x, w: reference.rms_norm(x, w, EPS), "torch", "llmu reference.rms_norm"),
            "torch": Provider(lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS), "builtin", "F.rms_norm"),
        },
        setup=_rms_setup,
        flops=lambda s: 4 * s["M"] * s["N"],
        bytes=lambda s, elem: (2 * s["M"] * s["N"] + s["N"]) * elem,
        gpu_sizes=RMS_SIZES_GPU,
        cpu_sizes=RMS_SIZES_CPU,
        x_axis="N",
    )
)

RMS_NORM_BWD = register(
    Entry(
        name="rms_norm_bwd",
        module="03_rope_swiglu_rmsnorm",
        description="RMSNorm backward: dx and dw from dy (dw summed over the M rows)",
        providers={
            "llmu triton": Provider(
                lambda x, w, dy, rstd, *_: rms_norm_backward(dy, x, w, rstd), "triton", "llmu Triton backward"),
            "llmu torch": Provider(
                lambda x, w, dy, rstd, xr, wr, y_ref, y_b: torch.autograd.grad(y_ref, (xr, wr), dy, retain_graph=True),
                "torch", "autograd through reference.rms_norm"),
            "torch": Provider(
                lambda x, w, dy, rstd, xr, wr, y_ref, y_b: torch.autograd.grad(y_b, (xr, wr), dy, retain_graph=True),
                "builtin", "autograd through F.rms_norm"),
        },
        setup=_rms_bwd_setup,
        flops=lambda s: 9 * s["M"] * s["N"],
        bytes=lambda s, elem: (3 * s["M"] * s["N"] + 2 * s["N"]) * elem,
        gpu_sizes=RMS_SIZES_GPU,
        cpu_sizes=RMS_SIZES_CPU,
        x_axis="N",
    )
)


# ------------------------------------------------------------------------------------------- RoPE

def _rope_setup(size, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    b, t, hq, hk, d = size["B"], size["T"], size["Hq"], size["Hk"], size["D"]
    q = _randn((b, hq, t, d), g, device, dtype)
    k = _randn((b, hk, t, d), g, device, dtype)
    cos, sin = reference.rope_angles(torch.arange(t, device="cpu"), d, 1e5)
    return q, k, cos.to(device), sin.to(device)


def _rope_torch(q, k, cos, sin):
    return reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)


ROPE = register(
    Entry(
        name="rope",
        module="03_rope_swiglu_rmsnorm",
        description="rotary embeddings on q (B,Hq,T,D) and k (B,Hk,T,D), half layout",
        providers={
            # In place: each call rotates q and k once more, which costs the same as the first time.
            "llmu triton": Provider(lambda q, k, cos, sin: rope(q, k, cos, sin), "triton", "llmu Triton rope (in place)"),
            "llmu torch": Provider(_rope_torch, "torch", "llmu reference.apply_rope"),
        },
        setup=_rope_setup,
        flops=lambda s: 3 * s["B"] * s["T"] * (s["Hq"] + s["Hk"]) * s["D"],
        bytes=lambda s, elem: 2 * s["B"] * s["T"] * (s["Hq"] + s["Hk"]) * s["D"] * elem + s["T"] * s["D"] * 4,
        # GPU: Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128); CPU: SmolLM2's (9/3/64).
        gpu_sizes=[{"B": 1, "T": t, "Hq": 32, "Hk": 8, "D": 128} for t in (512, 1024, 2048, 4096, 8192, 16384, 32768)],
        cpu_sizes=[{"B": 1, "T": t, "Hq": 9, "Hk": 3, "D": 64} for t in (64, 256, 1024)],
        x_axis="T",
    )
)


# ----------------------------------------------------------------------------------------- SwiGLU

def _swiglu_setup(size, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    return _randn((size["M"], size["N"]), g, device, dtype), _randn((size["M"], size["N"]), g, device, dtype)


def _swiglu_bwd_setup(size, device, dtype):
    gate, up = _swiglu_setup(size, device, dtype)
    dy = _randn((size["M"], size["N"]), torch.Generator(device="cpu").manual_seed(1), device, dtype)
    g_req, u_req = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    y_ref = reference.silu_mul(g_req, u_req)
    y_builtin = F.silu(g_req) * u_req
    return gate, up, dy, g_req, u_req, y_ref, y_builtin


SWIGLU_SIZES_GPU = [{"M": 4096, "N": n} for n in (1536, 2048, 4096, 8192, 14336, 28672)]
SWIGLU_SIZES_CPU = [{"M": 256, "N": n} for n in (1536, 4096)]

SWIGLU = register(
    Entry(
        name="swiglu",
        module="03_rope_swiglu_rmsnorm",
        description="the SwiGLU gate silu(gate) * up over M rows of N (the FFN width)",
        providers={
            "llmu triton": Provider(swiglu_fused, "triton", "llmu Triton swiglu_fused"),
            "llmu torch": Provider(reference.silu_mul, "torch", "llmu reference.silu_mul"),
            "torch": Provider(lambda g, u: F.silu(g) * u, "builtin", "F.silu(gate) * up"),
        },
        setup=_swiglu_setup,
        flops=lambda s: 5 * s["M"] * s["N"],
        bytes=lambda s, elem: 3 * s["M"] * s["N"] * elem,
        gpu_sizes=SWIGLU_SIZES_GPU,
        cpu_sizes=SWIGLU_SIZES_CPU,
        x_axis="N",
    )
)

SWIGLU_BWD = register(
    Entry(
        name="swiglu_bwd",
        module="03_rope_swiglu_rmsnorm",
        description="backward of silu(gate) * up: d_gate and d_up from dy",
        providers={
            "llmu triton": Provider(lambda g, u, dy, *_: swiglu_backward(dy, g, u), "triton", "llmu Triton backward"),
            "llmu torch": Provider(
                lambda g, u, dy, gr, ur, y_ref, y_b: torch.autograd.grad(y_ref, (gr, ur), dy, retain_graph=True),
                "torch", "autograd through reference.silu_mul"),
            "torch": Provider(
                lambda g, u, dy, gr, ur, y_ref, y_b: torch.autograd.grad(y_b, (gr, ur), dy, retain_graph=True),
                "builtin", "autograd through F.silu(gate) * up"),
        },
        setup=_swiglu_bwd_setup,
        flops=lambda s: 11 * s["M"] * s["N"],
        bytes=lambda s, elem: 5 * s["M"] * s["N"] * elem,
        gpu_sizes=SWIGLU_SIZES_GPU,
        cpu_sizes=SWIGLU_SIZES_CPU,
        x_axis="N",
    )
)
