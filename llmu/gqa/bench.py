"""Benchmark entry of module 07: one decode step of grouped-query attention, grouped vs per head.

``gqa_decode``: B sequences, each with one new query per head (``q (B, H, D)``), attend to T cached
positions of ``Hkv`` KV heads (``k``, ``v``: ``(B, Hkv, T, D)``), ``G = H / Hkv``.

FLOPs: two dot products of D multiply-adds per (query head, position): ``4·B·H·T·D``.

Both Triton providers run the same kernel, module 06's ``decode_attention`` (flash-decoding, in
``llmu/kvcache/kernels.py``), once with ``grouped=True`` and once with ``grouped=False``; only the
cut of the work into programs differs, so the gap between them is what grouping saves.

Bytes: the cache dominates. Reading each KV head once (grouped: one program per KV head holds its
G queries) moves

    grouped:   elem·(2·B·Hkv·T·D + 2·B·H·D)      (K and V once; q read, output written)

while one program per *query* head streams its KV head once per query head of the group:

    per head:  elem·(2·B·H·T·D + 2·B·H·D)        (G times the cache traffic)

The entry's ``bytes`` is the grouped (ideal) count for every provider, so GB/s compare like for
like: a per-head kernel that lands at about 1/G of the grouped one's GB/s is paying the G-fold
traffic (part of it may be served from the GPU's L2 cache when the KV head fits there, which is
why the measured gap can be smaller than G). :func:`per_head_bytes` is the other formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.bench.registry import Entry, Provider, register
from llmu.kvcache.kernels import decode_attention
from llmu.kvcache.reference import attend_cached


def _setup(size, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    b, h, hkv, t, d = size["B"], size["H"], size["Hkv"], size["T"], size["D"]
    q = torch.randn(b, h, d, generator=g, device="cpu")
    k = torch.randn(b, hkv, t, d, generator=g, device="cpu")
    v = torch.randn(b, hkv, t, d, generator=g, device="cpu")
    lengths = torch.full((b,), t, dtype=torch.int32, device="cpu")
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v)) + (lengths.to(device),)


def gqa_decode_flops(size) -> float:
    return 4 * size["B"] * size["H"] * size["T"] * size["D"]


def grouped_bytes(size, elem: int) -> float:
    b, h, hkv, t, d = size["B"], size["H"], size["Hkv"], size["T"], size["D"]
    return elem * (2 * b * hkv * t * d + 2 * b * h * d)


def per_head_bytes(size, elem: int) -> float:
    b, h, t, d = size["B"], size["H"], size["T"], size["D"]
    return elem * (2 * b * h * t * d + 2 * b * h * d)


def _grouped(q, k, v, lengths):
    return decode_attention(q, k, v, lengths, grouped=True)


def _per_head(q, k, v, lengths):
    return decode_attention(q, k, v, lengths, grouped=False)


def _sdpa(q, k, v, lengths):
    # every sequence is full length in this benchmark, so no mask is needed
    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]


GQA_DECODE = register(
    Entry(
        name="gqa_decode",
        module="07_gqa_mqa_mla",
        description="one decode step of grouped-query attention over a T-position cache: grouped vs per-head programs",
        providers={
            "llmu triton grouped": Provider(_grouped, "triton", "llmu decode_attention(grouped=True), one program per KV head"),
            "llmu triton per-head": Provider(_per_head, "triton",
                                             "llmu decode_attention(grouped=False), one program per query head"),
            "llmu torch": Provider(attend_cached, "torch", "llmu.kvcache.reference.attend_cached"),
            "torch": Provider(_sdpa, "builtin", "F.scaled_dot_product_attention(enable_gqa=True)"),
        },
        setup=_setup,
        flops=gqa_decode_flops,
        bytes=grouped_bytes,
        gpu_sizes=[{"B": 8, "H": 32, "Hkv": 8, "T": t, "D": 128} for t in (1024, 4096, 16384, 65536)]
        + [{"B": 8, "H": 32, "Hkv": 1, "T": t, "D": 128} for t in (4096, 65536)],
        cpu_sizes=[{"B": 1, "H": 9, "Hkv": 3, "T": t, "D": 64} for t in (256, 1024, 4096)],
        x_axis="T",
    )
)
