"""Benchmark entries of module 00: vector add and row softmax (both memory-bound).

Vector add, N elements: N additions; it reads x and y and writes the sum, 3·N·elem bytes.
Row softmax, M rows of N columns, counting per element one max comparison, one subtraction, one
exp, one addition into the sum and one division: 5·M·N operations (an exp costs a GPU several
instructions; it is counted as one, as is usual). Ideal traffic is one read and one write of the
matrix, 2·M·N·elem bytes. The llmu kernel reads a row twice (pass 1 for max and sum, pass 2 for
the output); for rows that fit in one block the second read usually hits the cache, for longer
rows it costs a third M·N·elem, which shows up as a lower effective GB/s.
"""

from __future__ import annotations

import torch

from llmu.bench.registry import Entry, Provider, register
from llmu.welcome import kernels, reference


def _add_setup(size, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(size["N"], generator=g, dtype=torch.float32, device="cpu").to(device=device, dtype=dtype)
    y = torch.randn(size["N"], generator=g, dtype=torch.float32, device="cpu").to(device=device, dtype=dtype)
    return x, y


def _softmax_setup(size, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(size["M"], size["N"], generator=g, dtype=torch.float32, device="cpu").to(device=device, dtype=dtype)
    return (x,)


VECTOR_ADD = register(
    Entry(
        name="vector_add",
        module="00_welcome",
        description="out = x + y over N elements",
        providers={
            "llmu triton": Provider(kernels.add, "triton", "llmu Triton add"),
            "torch": Provider(torch.add, "builtin", "torch.add"),
        },
        setup=_add_setup,
        flops=lambda s: s["N"],
        bytes=lambda s, elem: 3 * s["N"] * elem,
        gpu_sizes=[{"N": 2**k} for k in range(12, 29, 2)],
        cpu_sizes=[{"N": 2**k} for k in (12, 16, 20, 22)],
        x_axis="N",
    )
)

SOFTMAX = register(
    Entry(
        name="softmax_rows",
        module="00_welcome",
        description="softmax over the last dimension of an M x N matrix",
        providers={
            "llmu triton": Provider(kernels.softmax, "triton", "llmu Triton softmax"),
            "llmu torch": Provider(reference.stable_softmax, "torch", "llmu stable_softmax"),
            "torch": Provider(lambda x: torch.softmax(x, dim=-1), "builtin", "torch.softmax"),
        },
        setup=_softmax_setup,
        flops=lambda s: 5 * s["M"] * s["N"],
        bytes=lambda s, elem: 2 * s["M"] * s["N"] * elem,
        gpu_sizes=[{"M": 4096, "N": n} for n in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)],
        cpu_sizes=[{"M": 256, "N": n} for n in (256, 1024, 4096)],
        x_axis="N",
    )
)
