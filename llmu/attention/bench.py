"""Benchmark entries of module 02: softmax with temperature over a vocabulary, naive attention.

``softmax_temperature``: ``softmax(x / T)`` over M rows of N logits (a batch of next-token
distributions; N = 49152 is SmolLM2's vocabulary). Per element: one division by T, one max
comparison, one subtraction, one exp, one addition into the sum and one division by the sum,
so 6·M·N operations (an exp is counted as one, as is usual). The ideal traffic is one read of the
logits and one write of the probabilities, 2·M·N·elem bytes. The llmu kernel reads rows longer
than ``SOFTMAX_ONE_BLOCK_MAX`` twice (3·M·N·elem in all), so its GB/s measured against the ideal
count drops for those rows: the gap is the price of the second pass.

``attention_naive``: ``softmax(q k^T / sqrt(D) + mask) v`` with q ``(B, H, T, D)`` and k, v
``(B, Hkv, T, D)``. FLOPs: two matrix products of 2·D operations per (query, key) pair, so
4·B·H·pairs·D, where ``pairs`` is T·T without a mask and T·(T+1)/2 with the causal mask (about
half: the kernels skip the blocks above the diagonal). The softmax's few operations per score are
left out, as usual. Bytes: reading q, k, v and writing the output, plus the round trip of the
float32 score matrix that the naive algorithm writes and reads back (4 bytes · B·H·T·T each way):

    bytes = elem·(2·B·H·T·D + 2·B·Hkv·T·D) + 2·4·B·H·T·T

This is the traffic of the *naive algorithm*, used for every provider so that their GB/s compare
like for like. The llmu kernel actually reads its scores twice; the torch reference makes a few
more passes (mask, softmax); PyTorch's built-in on a GPU runs a fused FlashAttention kernel that
never writes the scores, so its "GB/s" can exceed the memory's peak: that gap is module 08.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.attention import kernels, reference
from llmu.bench.registry import Entry, Provider, register

#: The temperature every softmax provider applies (any positive value costs the same).
TEMPERATURE = 0.7


def _softmax_setup(size, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(size["M"], size["N"], generator=g, device="cpu") * 3
    return (x.to(device=device, dtype=dtype),)


def _attention_setup(size, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    b, h, hkv, t, d = size["B"], size["H"], size["Hkv"], size["T"], size["D"]
    q = torch.randn(b, h, t, d, generator=g, device="cpu")
    k = torch.randn(b, hkv, t, d, generator=g, device="cpu")
    v = torch.randn(b, hkv, t, d, generator=g, device="cpu")
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v)) + (bool(size["causal"]),)


def softmax_flops(size) -> float:
    return 6 * size["M"] * size["N"]


def softmax_bytes(size, elem: int) -> float:
    return 2 * size["M"] * size["N"] * elem


def attention_pairs(size) -> float:
    """(query, key) pairs that are computed: T·T, or T·(T+1)/2 under the causal mask."""
    t = size["T"]
    return t * (t + 1) / 2 if size["causal"] else t * t


def attention_flops(size) -> float:
    return 4 * size["B"] * size["H"] * attention_pairs(size) * size["D"]


def attention_bytes(size, elem: int) -> float:
    b, h, hkv, t, d = size["B"], size["H"], size["Hkv"], size["T"], size["D"]
    qkvo = elem * (2 * b * h * t * d + 2 * b * hkv * t * d)
    scores_round_trip = 2 * 4 * b * h * t * t
    return qkvo + scores_round_trip


SOFTMAX_TEMPERATURE = register(
    Entry(
        name="softmax_temperature",
        module="02_attention",
        description=f"softmax(x / T) over M rows of N logits (T = {TEMPERATURE})",
        providers={
            "llmu triton": Provider(lambda x: kernels.softmax(x, TEMPERATURE), "triton", "llmu Triton softmax"),
            "llmu torch": Provider(lambda x: reference.softmax(x, -1, TEMPERATURE), "torch", "llmu reference.softmax"),
            "torch": Provider(lambda x: torch.softmax(x / TEMPERATURE, dim=-1), "builtin", "torch.softmax(x / T)"),
        },
        setup=_softmax_setup,
        flops=softmax_flops,
        bytes=softmax_bytes,
        gpu_sizes=[{"M": 256, "N": n} for n in (1024, 4096, 8192, 16384, 32768, 49152, 131072)],
        cpu_sizes=[{"M": 64, "N": n} for n in (1024, 8192, 49152)],
        x_axis="N",
    )
)

ATTENTION_NAIVE = register(
    Entry(
        name="attention_naive",
        module="02_attention",
        description="softmax(q k^T / sqrt(D) + causal mask) v, grouped-query heads, scores materialised",
        providers={
            "llmu triton": Provider(lambda q, k, v, c: kernels.attention(q, k, v, causal=c), "triton",
                                    "llmu Triton naive attention"),
            "llmu torch": Provider(lambda q, k, v, c: reference.attention(q, k, v, causal=c), "torch",
                                   "llmu reference.attention"),
            # With T queries and T keys, SDPA's top-left causal mask is the course's mask.
            "torch": Provider(lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c, enable_gqa=True),
                              "builtin", "F.scaled_dot_product_attention"),
        },
        setup=_attention_setup,
        flops=attention_flops,
        bytes=attention_bytes,
        gpu_sizes=[{"B": 2, "H": 32, "Hkv": 8, "T": t, "D": 128, "causal": True} for t in (256, 512, 1024, 2048, 4096)],
        cpu_sizes=[{"B": 1, "H": 9, "Hkv": 3, "T": t, "D": 64, "causal": True} for t in (64, 256, 512)],
        x_axis="T",
    )
)
