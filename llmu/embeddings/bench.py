"""Benchmark entry of module 01: cosine similarity of Q queries against a V x D table.

FLOPs: the Q x V dot products of length D cost 2·Q·V·D (a multiply and an add each); the norms
(2·(Q+V)·D per tile row/column) and the final division (Q·V) are lower-order and left out.
Bytes: read both inputs once and write the scores, (Q·D + V·D + Q·V)·elem. The kernel re-reads the
table once per block of BLOCK_Q queries (and the queries once per block of table rows), so at large
Q the real traffic is higher; those re-reads mostly hit the L2 cache.
With Q small (a handful of query words against a 49152-word vocabulary) the op is memory-bound:
it streams the table once for very few FLOPs per byte. With Q in the thousands it turns into a
matrix multiply and becomes compute-bound.
"""

from __future__ import annotations

import torch

from llmu.bench.registry import Entry, Provider, register
from llmu.embeddings import kernels, reference


def _setup(size, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(size["Q"], size["D"], generator=g).to(device=device, dtype=dtype)
    table = torch.randn(size["V"], size["D"], generator=g).to(device=device, dtype=dtype)
    return q, table


def _builtin(q, table):
    # F.cosine_similarity broadcasts (Q, 1, D) against (1, V, D): it materialises a Q x V x D
    # product, which is why it is much slower than a matrix multiply.
    return torch.nn.functional.cosine_similarity(q[:, None, :], table[None, :, :], dim=-1)


COSINE = register(
    Entry(
        name="cosine_similarity",
        module="01_embeddings",
        description="cosine similarity of Q x D queries against a V x D table",
        providers={
            "llmu triton": Provider(kernels.cosine_similarity, "triton", "llmu Triton cosine_similarity"),
            "llmu torch": Provider(reference.cosine_similarity_matrix, "torch", "llmu cosine_similarity_matrix"),
            "torch": Provider(_builtin, "builtin", "F.cosine_similarity (broadcast)"),
        },
        setup=_setup,
        flops=lambda s: 2 * s["Q"] * s["V"] * s["D"],
        bytes=lambda s, elem: (s["Q"] * s["D"] + s["V"] * s["D"] + s["Q"] * s["V"]) * elem,
        gpu_sizes=[{"Q": q, "V": 49152, "D": 576} for q in (1, 8, 64, 256, 1024, 4096)],
        cpu_sizes=[{"Q": q, "V": 4096, "D": 576} for q in (1, 4, 16)],
        x_axis="Q",
    )
)
