"""Benchmark entries of module 08: FlashAttention forward, and forward + backward.

Sizes follow the FlashAttention-2 paper's benchmark: 16k tokens per batch (``B = 16384 / T``),
model width 2048 (``H = 2048 / D`` heads), sequence length T from 512 to 16k, head dim 64 and 128,
causal and not. ``Hkv = H`` (plain multi-head attention, as in the paper).

FLOPs, counted as the FlashAttention papers do: the forward is two matrix products of
``2·T·T·D`` each per (batch, head), ``4·B·H·T²·D``, halved under the causal mask (half the
(query, key) pairs are computed). The backward does five such products (recomputing S, then
dV, dP, dQ, dK), 2.5 times the forward, so forward + backward is ``3.5 ×`` the forward count.
The softmax's exponentials are not counted.

Bytes: the ideal traffic of the tiled algorithm (q, k, v read, the output written, the float32
log-sum-exp written), ``elem·(2·B·H·T·D + 2·B·Hkv·T·D) + 4·B·H·T``; for forward + backward add
the backward's reads of q, k, v, o, dO and lse and writes of dq, dk, dv and D. Attention at these
sizes is compute-bound: the TFLOP/s column is the one that matters.

Providers: llmu's Triton kernel, llmu's torch tiled reference (a Python loop over tiles: it shows
the algorithm, not speed; refused above T = 2048 to keep the GPU run short), PyTorch's
``scaled_dot_product_attention`` (its flash backend on a GPU) and naive attention (the full score
matrix, refused above T = 4096 where it needs tens of GB).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.attention.reference import attention as naive_attention
from llmu.bench.registry import Entry, Provider, register
from llmu.flash import kernels, reference

#: Largest T the slow providers are run at.
TORCH_TILED_MAX_T = 2048
NAIVE_MAX_T = 4096


def _setup(size, device, dtype, grad=False):
    g = torch.Generator(device="cpu").manual_seed(0)
    b, h, hkv, t, d = size["B"], size["H"], size["Hkv"], size["T"], size["D"]
    q = torch.randn(b, h, t, d, generator=g, device="cpu")
    k = torch.randn(b, hkv, t, d, generator=g, device="cpu")
    v = torch.randn(b, hkv, t, d, generator=g, device="cpu")
    q, k, v = (x.to(device=device, dtype=dtype).requires_grad_(grad) for x in (q, k, v))
    do = torch.randn(b, h, t, d, generator=g, device="cpu").to(device=device, dtype=dtype)
    return (q, k, v, bool(size["causal"])) + ((do,) if grad else ())


def _setup_bwd(size, device, dtype):
    return _setup(size, device, dtype, grad=True)


def fwd_flops(size) -> float:
    f = 4 * size["B"] * size["H"] * size["T"] * size["T"] * size["D"]
    return f / 2 if size["causal"] else f


def fwd_bwd_flops(size) -> float:
    return 3.5 * fwd_flops(size)


def fwd_bytes(size, elem: int) -> float:
    b, h, hkv, t, d = size["B"], size["H"], size["Hkv"], size["T"], size["D"]
    return elem * (2 * b * h * t * d + 2 * b * hkv * t * d) + 4 * b * h * t


def fwd_bwd_bytes(size, elem: int) -> float:
    b, h, hkv, t, d = size["B"], size["H"], size["Hkv"], size["T"], size["D"]
    backward = elem * (4 * b * h * t * d + 4 * b * hkv * t * d + b * h * t * d) + 2 * 4 * b * h * t
    return fwd_bytes(size, elem) + backward


def _refuse_above(q, limit, what):
    if q.shape[2] > limit:
        raise ValueError(f"{what} is not run above T={limit} (too slow or too big; see llmu.flash.bench)")


def _tiled(q, k, v, c):
    _refuse_above(q, TORCH_TILED_MAX_T, "the torch tiled reference")
    return reference.flash_attention(q, k, v, causal=c, block_q=128, block_k=128)[0]


def _naive(q, k, v, c):
    _refuse_above(q, NAIVE_MAX_T, "naive attention")
    return naive_attention(q, k, v, causal=c)


def _sdpa(q, k, v, c):
    return F.scaled_dot_product_attention(q, k, v, is_causal=c, enable_gqa=q.shape[1] != k.shape[1])


def _triton(q, k, v, c):
    return kernels.flash_attention(q, k, v, causal=c)


def _backward(fn):
    def run(q, k, v, c, do):
        out = fn(q, k, v, c)
        return torch.autograd.grad(out, (q, k, v), do)
    return run


def _tiled_bwd(q, k, v, c, do):
    # the torch reference's backward: the formulas of attention_backward from the saved lse
    _refuse_above(q, TORCH_TILED_MAX_T, "the torch tiled reference")
    with torch.no_grad():
        out, lse = reference.flash_attention(q, k, v, causal=c, block_q=128, block_k=128)
        return reference.attention_backward(q, k, v, out, lse, do, causal=c)


GPU_SIZES = [{"B": 16384 // t, "H": 2048 // d, "Hkv": 2048 // d, "T": t, "D": d, "causal": c}
             for c in (False, True) for d in (64, 128) for t in (512, 1024, 2048, 4096, 8192, 16384)]
CPU_SIZES = [{"B": 1, "H": 4, "Hkv": 4, "T": t, "D": 64, "causal": True} for t in (128, 256, 512)]

FLASH_FORWARD = register(
    Entry(
        name="flash_attention_fwd",
        module="08_flash_attention",
        description="FlashAttention forward, softmax(q k^T / sqrt(D) + mask) v, 16k tokens per batch, width 2048",
        providers={
            "llmu triton": Provider(_triton, "triton", "llmu FlashAttention-2 Triton kernel"),
            "llmu torch": Provider(_tiled, "torch", "llmu.flash.reference.flash_attention (tiles of 128)"),
            "torch sdpa": Provider(_sdpa, "builtin", "F.scaled_dot_product_attention"),
            "naive": Provider(_naive, "torch", "llmu.attention.reference.attention (N x N scores)"),
        },
        setup=_setup,
        flops=fwd_flops,
        bytes=fwd_bytes,
        gpu_sizes=GPU_SIZES,
        cpu_sizes=CPU_SIZES,
        x_axis="T",
    )
)

FLASH_FORWARD_BACKWARD = register(
    Entry(
        name="flash_attention_fwd_bwd",
        module="08_flash_attention",
        description="FlashAttention forward + backward (dq, dk, dv), 16k tokens per batch, width 2048",
        providers={
            "llmu triton": Provider(_backward(_triton), "triton", "llmu FlashAttention-2 Triton kernels"),
            "llmu torch": Provider(_tiled_bwd, "torch", "llmu.flash.reference forward + attention_backward"),
            "torch sdpa": Provider(_backward(_sdpa), "builtin", "F.scaled_dot_product_attention + autograd"),
            "naive": Provider(_backward(_naive), "torch", "naive attention + autograd"),
        },
        setup=_setup_bwd,
        flops=fwd_bwd_flops,
        bytes=fwd_bwd_bytes,
        gpu_sizes=GPU_SIZES,
        cpu_sizes=CPU_SIZES,
        x_axis="T",
    )
)
