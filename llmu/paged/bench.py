"""Benchmark entries of module 09: what reading the KV cache through block tables costs.

Every size builds one paged pool of blocks of ``block_size`` positions whose physical blocks are
a random permutation (the worst case for locality a block manager can produce: no two blocks of a
sequence are neighbours), and the very same keys and values laid out contiguously, so that the
paged kernels and the course's contiguous kernels are timed on identical data.

``paged_decode_attention``: one query token per sequence (``q (B, H, D)``) against ``T`` cached
positions per sequence (``Hkv`` KV heads), all sequences of length ``T``. Memory-bound: every key
and value is read once for ``4 * G * D`` FLOPs per position (``G = H / Hkv`` query heads share it).

    flops = 4 * B * H * T * D
    bytes = elem * (2 * B * Hkv * T * D            K and V of every context position, read once
                    + 2 * B * H * D)               q read, out written
            + 4 * B * ceil(T / block_size)         the block tables (int32)

Providers: the llmu Triton paged kernel; module 06's grouped flash-decoding kernel
(``llmu.kvcache.kernels.decode_attention``) on the contiguous copy — the bar to reach: on a GPU
the paged kernel should move at least 80 % of the contiguous kernel's GB/s; and the llmu torch
path the model uses on a CPU (``llmu.paged.cache.torch_paged_attention``: gather every table,
then PyTorch's fused attention). GB/s are counted against the same ideal bytes for every
provider (the contiguous kernel reads no table: 4 bytes per 16 positions, invisible in the sum).

``paged_prefill_attention``: ``B`` sequences of ``ctx`` positions whose last ``q`` are new (a
chunk after a cached prefix when ``q < ctx``, a whole prompt when ``q == ctx``), causal. Query
``i`` of a chunk (position ``ctx - q + i``) sees ``ctx - q + i + 1`` keys, so the (query, key)
pairs per sequence and head are ``q * (ctx - q) + q * (q + 1) / 2`` and

    flops = 4 * B * H * D * (q * (ctx - q) + q * (q + 1) / 2)        (q k^T and p v, 2 FLOPs a product)
    bytes = elem * (2 * B * Hkv * ctx * D + 2 * B * H * q * D) + 4 * B * ceil(ctx / block_size)

Long chunks are compute-bound (TFLOP/s is the column to read), short chunks after a long prefix
read the whole cache for few queries and lean towards memory. Providers: the llmu Triton paged
prefill kernel; module 08's FlashAttention-2 kernel (``llmu.flash.kernels.flash_attention``,
causal bottom-right) on the contiguous copy; the llmu torch path.

``kv_waste`` (a ``run=`` entry, no timing): the fraction of a KV cache's memory that holds no key
or value while ``requests`` chat-like requests are served (``llmu.paged.waste``: a step-by-step
simulation, first come first served, in a budget of ``budget`` positions), for each way of
allocating it: reserving the whole ``max_len`` context per request, reserving prompt +
``max_tokens``, an oracle that reserves exactly what each request will use, and paging with blocks
of 16 (the real ``BlockManager``). The vLLM paper reports 60–80 % waste before paging, under 4 %
after; rows carry ``kv_waste`` (average over steps), ``kv_waste_peak`` and the concurrency.
"""

from __future__ import annotations

import math

import torch

from llmu.bench.registry import Entry, Provider, register
from llmu.flash.kernels import flash_attention
from llmu.kvcache.kernels import decode_attention
from llmu.paged import kernels
from llmu.paged.cache import torch_paged_attention

MODULE = "09_paged_attention"


# ----------------------------------------------------------------------------------------------
# Inputs: one pool with shuffled blocks, and the same data contiguous
# ----------------------------------------------------------------------------------------------


def _paged_setup(b, h, hkv, ctx, q_len, d, block_size, device, dtype):
    """``(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, k, v)``.

    ``q`` ``(B * q_len, H, D)`` packed; the pool holds exactly the blocks the sequences need, in a
    random order; ``k``, ``v`` ``(B, Hkv, ctx, D)`` are the same positions, contiguous.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    per_seq = -(-ctx // block_size)
    num_blocks = b * per_seq
    # Filled on the device: gigabytes of cache would take long to make on the host and copy over.
    k_cache = torch.randn(num_blocks, block_size, hkv, d, device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=g, device="cpu").view(b, per_seq).to(device=device, dtype=torch.int32)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    cu = torch.arange(0, (b + 1) * q_len, q_len, dtype=torch.int32, device=device)
    q = torch.randn(b * q_len, h, d, generator=g, device="cpu").to(device=device, dtype=dtype)
    # the contiguous copy: position p of sequence i is row p % bs of block tables[i, p // bs]
    k = k_cache[tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    v = v_cache[tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    return q, k_cache, v_cache, tables, lens, cu, k, v


def _decode_setup(size, device, dtype):
    return _paged_setup(size["B"], size["H"], size["Hkv"], size["T"], 1, size["D"], size["block_size"],
                        device, dtype)


def _prefill_setup(size, device, dtype):
    return _paged_setup(size["B"], size["H"], size["Hkv"], size["ctx"], size["q"], size["D"], size["block_size"],
                        device, dtype)


# ----------------------------------------------------------------------------------------------
# Costs
# ----------------------------------------------------------------------------------------------


def decode_flops(size) -> float:
    return 4.0 * size["B"] * size["H"] * size["T"] * size["D"]


def decode_bytes(size, elem: int) -> float:
    b, h, hkv, t, d = size["B"], size["H"], size["Hkv"], size["T"], size["D"]
    tables = 4 * b * math.ceil(t / size["block_size"])
    return float(elem * (2 * b * hkv * t * d + 2 * b * h * d) + tables)


def prefill_pairs(ctx: int, q: int) -> float:
    """(query, key) pairs of one causal chunk of ``q`` queries that end a context of ``ctx``."""
    return q * (ctx - q) + q * (q + 1) / 2


def prefill_flops(size) -> float:
    return 4.0 * size["B"] * size["H"] * size["D"] * prefill_pairs(size["ctx"], size["q"])


def prefill_bytes(size, elem: int) -> float:
    b, h, hkv, ctx, q, d = size["B"], size["H"], size["Hkv"], size["ctx"], size["q"], size["D"]
    tables = 4 * b * math.ceil(ctx / size["block_size"])
    return float(elem * (2 * b * hkv * ctx * d + 2 * b * h * q * d) + tables)


# ----------------------------------------------------------------------------------------------
# Providers (each takes the whole setup tuple and uses its part)
# ----------------------------------------------------------------------------------------------


def _paged_decode(q, kc, vc, tables, lens, cu, k, v):
    return kernels.paged_decode_attention(q, kc, vc, tables, lens)


def _contiguous_decode(q, kc, vc, tables, lens, cu, k, v):
    return decode_attention(q, k, v, lens)


def _torch_decode(q, kc, vc, tables, lens, cu, k, v):
    return torch_paged_attention(q, kc, vc, tables, cu, lens, scale=1.0 / math.sqrt(q.shape[-1]), decode_only=True)


def _paged_prefill(q, kc, vc, tables, lens, cu, k, v):
    return kernels.paged_prefill_attention(q, kc, vc, tables, cu, lens)


def _contiguous_prefill(q, kc, vc, tables, lens, cu, k, v):
    b, h, d = k.shape[0], q.shape[1], q.shape[2]
    # (B * q, H, D) -> (B, H, q, D); the transpose is part of the call, as the packed layout would need it
    q4 = q.view(b, -1, h, d).transpose(1, 2)
    return flash_attention(q4, k, v, causal=True)


def _torch_prefill(q, kc, vc, tables, lens, cu, k, v):
    return torch_paged_attention(q, kc, vc, tables, cu, lens, scale=1.0 / math.sqrt(q.shape[-1]), decode_only=False)


# ----------------------------------------------------------------------------------------------
# Entries
# ----------------------------------------------------------------------------------------------

PAGED_DECODE = register(
    Entry(
        name="paged_decode_attention",
        module=MODULE,
        description="one query token per sequence against T positions read through block tables (16-position "
                    "blocks, shuffled), vs the same cache contiguous",
        providers={
            "llmu triton": Provider(_paged_decode, "triton", "llmu Triton paged decode (block tables)"),
            "llmu triton contiguous": Provider(_contiguous_decode, "triton",
                                               "module 06 Triton decode on the contiguous cache (same data)"),
            "llmu torch": Provider(_torch_decode, "torch", "llmu torch_paged_attention (gather + SDPA)"),
        },
        setup=_decode_setup,
        flops=decode_flops,
        bytes=decode_bytes,
        gpu_sizes=[{"B": b, "H": h, "Hkv": 8, "T": t, "D": 128, "block_size": 16}
                   for b, h, t in [(b, 32, t) for b in (32, 64) for t in (1024, 2048, 4096, 8192)]
                   + [(32, 64, 4096), (64, 64, 8192)]],
        cpu_sizes=[{"B": 4, "H": 9, "Hkv": 3, "T": t, "D": 64, "block_size": 16} for t in (128, 512, 2048)],
        x_axis="T",
    )
)

PAGED_PREFILL = register(
    Entry(
        name="paged_prefill_attention",
        module=MODULE,
        description="causal query chunks (the last q of ctx positions) against paged contexts, vs FlashAttention-2 "
                    "on the same cache contiguous",
        providers={
            "llmu triton": Provider(_paged_prefill, "triton", "llmu Triton paged prefill (block tables)"),
            "llmu triton contiguous": Provider(_contiguous_prefill, "triton",
                                               "module 08 FlashAttention-2 Triton on the contiguous cache"),
            "llmu torch": Provider(_torch_prefill, "torch", "llmu torch_paged_attention (per-sequence SDPA)"),
        },
        setup=_prefill_setup,
        flops=prefill_flops,
        bytes=prefill_bytes,
        gpu_sizes=[{"B": b, "H": 32, "Hkv": 8, "ctx": ctx, "q": q, "D": 128, "block_size": 16}
                   for b, ctx, q in ((16, 1024, 1024), (8, 2048, 2048), (4, 4096, 4096), (2, 8192, 8192),
                                     (8, 4096, 512), (32, 2048, 256))],
        cpu_sizes=[{"B": 2, "H": 9, "Hkv": 3, "ctx": ctx, "q": q, "D": 64, "block_size": 16}
                   for ctx, q in ((64, 64), (256, 256), (256, 32))],
        x_axis="ctx",
    )
)


def _run_waste(size: dict, device) -> list[dict]:
    from llmu.paged import waste

    requests = waste.workload(size.get("requests", 64), seed=size.get("seed", 0), max_len=size.get("max_len", 2048))
    rows = []
    for sim in waste.compare(requests, budget=size.get("budget", waste.BUDGET), max_len=size.get("max_len", 2048),
                             block_size=size.get("block_size", 16)):
        rows.append(dict(
            provider=sim.policy, label=sim.label, kind="torch", ms=None,
            kv_waste=sim.average.waste_fraction, kv_waste_peak=sim.peak.waste_fraction,
            mean_running=sim.mean_running, steps=sim.num_steps,
            reason=(f"waste {100 * sim.average.waste_fraction:.1f}% (peak {100 * sim.peak.waste_fraction:.1f}%), "
                    f"{sim.mean_running:.1f} running on average, {sim.num_steps} steps"),
        ))
    return rows


KV_WASTE = register(
    Entry(
        name="kv_waste",
        module=MODULE,
        description="KV memory holding nothing while 64 chat-like requests are served: contiguous reservation "
                    "(max length 2048, prompt + max_tokens, exact) vs paged blocks of 16",
        run=_run_waste,
        gpu_sizes=[{"requests": 64, "max_len": 2048, "block_size": 16}],
        cpu_sizes=[{"requests": 64, "max_len": 2048, "block_size": 16}],
        x_axis="requests",
    )
)
