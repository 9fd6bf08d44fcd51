"""Benchmark entries of module 10's kernels: what reading int4 and int8 weights saves, and when.

Every size is one linear layer ``y = x @ W^T`` with ``x`` ``(M, K)`` (``M`` tokens: the batch in
decode, the prompt in prefill) and ``W`` ``(N, K)``, taken from 7B-class models: ``4096 x 4096``
(an attention projection), ``11008 x 4096`` / ``4096 x 11008`` (Llama-2-7B's MLP up and down) and
``14336 x 4096`` / ``4096 x 14336`` (Llama-3-8B's, Mistral-7B's). The weights are random, quantized
with :func:`llmu.quant.formats.quantize` (round to nearest) on the device.

``int4_gemv`` (decode, ``M`` = 1 .. 16) and ``int4_gemm`` (prefill, ``M`` = 512 .. 4096): int4
codes packed two a byte, float32 scale and zero per group of ``G`` inputs::

    flops = 2 * M * N * K
    bytes = N * K / 2                      packed codes, half a byte per weight
            + 2 * 4 * N * (K / G)          float32 scales and zeros
            + elem * (M * K + M * N)       x read, y written (elem = 2 in bf16)

Providers: the llmu Triton kernel (:func:`llmu.quant.kernels.int4_matmul`); PyTorch's bf16
``F.linear`` on the unquantized weights (kind ``"builtin"``: the bar, it reads ``2 * N * K``
bytes of weights); and dequantize-then-matmul in torch (kind ``"torch"``: unpack, rebuild ``W``
in bf16 in memory, ``F.linear``: what a quantized layer costs without a fused kernel). GB/s are
counted against the int4 bytes above for every provider, so read them as *effective* bandwidth
(``ms`` is what compares providers). The GPU target: at ``M = 1`` the int4 GEMV at least 2.5x
faster than bf16 (4096 x 4096 and up; 3.6x fewer bytes at ``G = 128``). At prefill sizes
(``int4_gemm``) both are compute-bound: int4 is expected to be no faster than bf16 (see
:mod:`llmu.quant.kernels`).

``int8_gemv``: int8 codes one a byte, one float32 scale per output row::

    flops = 2 * M * N * K
    bytes = N * K + 4 * N + elem * (M * K + M * N)

Providers: :func:`llmu.quant.kernels.int8_matmul`, bf16 ``F.linear``, and torch
``F.linear(x, codes.to(dtype) * scale)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.bench.registry import Entry, Provider, register
from llmu.quant import formats, kernels

MODULE = "10_quantization"

#: (N, K) of the GPU sizes: 7B-class attention and MLP projections.
LAYERS = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336)]


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def _weights(size, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(size["M"], size["K"], generator=g, device="cpu").to(device=device, dtype=dtype)
    # Made on the device: a 14336 x 4096 matrix would be slow to make on the host and copy over.
    w = (torch.randn(size["N"], size["K"], device=device) * 0.02).to(dtype)
    return x, w


def _int4_setup(size, device, dtype):
    """``(x, packed, scale, zero, G, w)``: ``w`` the unquantized weights in ``dtype`` (for F.linear)."""
    x, w = _weights(size, device, dtype)
    qt = formats.quantize(w, 4, group_size=size["G"])
    return x, qt.packed(), qt.scale, qt.zero, size["G"], w


def _int8_setup(size, device, dtype):
    """``(x, codes int8, scale (N,), w)``."""
    x, w = _weights(size, device, dtype)
    codes, scale = kernels.int8_codes(formats.quantize(w, 8, symmetric=True, granularity="channel"))
    return x, codes, scale, w


# ----------------------------------------------------------------------------------------------
# Costs
# ----------------------------------------------------------------------------------------------


def matmul_flops(size) -> float:
    return 2.0 * size["M"] * size["N"] * size["K"]


def int4_bytes(size, elem: int) -> float:
    m, n, k, g = size["M"], size["N"], size["K"], size["G"]
    return float(n * k // 2 + 2 * 4 * n * (k // g) + elem * (m * k + m * n))


def int8_bytes(size, elem: int) -> float:
    m, n, k = size["M"], size["N"], size["K"]
    return float(n * k + 4 * n + elem * (m * k + m * n))


# ----------------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------------


def _int4_triton(x, packed, scale, zero, g, w):
    return kernels.int4_matmul(x, packed, scale, zero, g)


def _int4_torch(x, packed, scale, zero, g, w):
    """Unpack, rebuild W in x's dtype in memory, then PyTorch's matmul: no fused kernel."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    q = formats.unpack_int4(packed).view(n, k // g, g).float()
    wd = ((q - zero[..., None]) * scale[..., None]).view(n, k).to(x.dtype)
    return F.linear(x, wd)


def _int4_linear(x, packed, scale, zero, g, w):
    return F.linear(x, w)


def _int8_triton(x, codes, scale, w):
    return kernels.int8_matmul(x, codes, scale)


def _int8_torch(x, codes, scale, w):
    return F.linear(x, (codes.to(torch.float32) * scale[:, None]).to(x.dtype))


def _int8_linear(x, codes, scale, w):
    return F.linear(x, w)


# ----------------------------------------------------------------------------------------------
# Entries
# ----------------------------------------------------------------------------------------------

def _int4_providers():
    return {
        "llmu triton": Provider(_int4_triton, "triton", "llmu Triton int4 (packed, group scales and zeros)"),
        "torch bf16": Provider(_int4_linear, "builtin", "PyTorch F.linear on the unquantized weights"),
        "llmu torch": Provider(_int4_torch, "torch", "torch: dequantize to a full matrix, then F.linear"),
    }


INT4_GEMV = register(
    Entry(
        name="int4_gemv",
        module=MODULE,
        description="decode: a batch of 1 to 16 tokens through one int4 layer (G = 128), vs bf16 F.linear "
                    "and torch dequantize-then-matmul",
        providers=_int4_providers(),
        setup=_int4_setup,
        flops=matmul_flops,
        bytes=int4_bytes,
        gpu_sizes=[{"M": m, "N": n, "K": k, "G": 128} for n, k in LAYERS for m in (1, 4, 16)],
        cpu_sizes=[{"M": m, "N": 576, "K": 1536, "G": 128} for m in (1, 4, 16)],
        x_axis="M",
    )
)

INT4_GEMM = register(
    Entry(
        name="int4_gemm",
        module=MODULE,
        description="prefill: 512 to 4096 tokens through one int4 layer (G = 128): compute-bound, int4 should "
                    "not beat bf16 here",
        providers=_int4_providers(),
        setup=_int4_setup,
        flops=matmul_flops,
        bytes=int4_bytes,
        gpu_sizes=[{"M": m, "N": n, "K": k, "G": 128} for n, k in ((4096, 4096), (14336, 4096))
                   for m in (512, 1024, 2048, 4096)],
        cpu_sizes=[{"M": m, "N": 576, "K": 576, "G": 64} for m in (64, 256)],
        x_axis="M",
    )
)

INT8_GEMV = register(
    Entry(
        name="int8_gemv",
        module=MODULE,
        description="decode: a batch of 1 to 16 tokens through one int8 layer (one scale per row), vs bf16 "
                    "F.linear and torch dequantize-then-matmul",
        providers={
            "llmu triton": Provider(_int8_triton, "triton", "llmu Triton int8 (scale per output row)"),
            "torch bf16": Provider(_int8_linear, "builtin", "PyTorch F.linear on the unquantized weights"),
            "llmu torch": Provider(_int8_torch, "torch", "torch: codes * scale to a full matrix, then F.linear"),
        },
        setup=_int8_setup,
        flops=matmul_flops,
        bytes=int8_bytes,
        gpu_sizes=[{"M": m, "N": n, "K": k} for n, k in LAYERS for m in (1, 16)],
        cpu_sizes=[{"M": m, "N": 576, "K": 1536} for m in (1, 16)],
        x_axis="M",
    )
)
