"""Benchmark entry of module 13: the selective scan against attention, as the sequence grows.

``mamba_selective_scan`` mixes a sequence of ``L`` tokens at model width ``D`` two ways: Mamba's
selective scan (``D`` channels, state ``N`` per channel, linear in ``L``) and causal softmax
attention over the same tokens (``D / Dh`` heads of ``Dh``, quadratic in ``L``). It is the
experiment of the Mamba paper (Gu & Dao 2023, section 4.5 and Fig. 8, setup in appendix E.5): the
scan operation alone (no projections, no convolution) against FlashAttention-2 with a causal mask,
batch 1, model dimension 1024, state ``N = 16``, bfloat16 inputs, ``L`` from 512 upwards; there the
fused scan is faster than attention beyond about 2k tokens and 20 to 40 times faster than a scan
written in plain PyTorch.

Providers (the first three compute the same scan; the last two the same attention):

- ``llmu triton``: ``kernels.selective_scan_triton``, the chunked scan with the state in registers;
- ``torch parallel``: ``reference.selective_scan_parallel`` (Hillis–Steele): it materialises the
  ``(B, D, L, N)`` float32 tensors ``exp(Δ A)`` and ``Δ B u`` and makes ``log2 L`` passes over them
  (refused above ``L = 32768``: at 65536 each of them is 4 GB at the GPU width, and the scan's
  rounds make several more);
- ``torch sequential``: ``reference.selective_scan_sequential``, a Python loop over time, a few
  small launches per token (refused above ``L = 2048``);
- ``llmu flash``: module 08's FlashAttention Triton kernel, causal;
- ``torch sdpa``: ``F.scaled_dot_product_attention(is_causal=True)`` (its flash backend on a GPU).

The scan is Mamba's full selective-scan call: ``Δ`` with a bias and softplus, input-dependent ``B``
and ``C`` ``(batch, N, L)`` shared by all channels, the skip ``D`` and the gate ``silu(z)``. Values
as Mamba initialises them: ``A = -(1, 2, ..., N)`` per channel (S4D-real), ``delta_bias`` the
inverse softplus of a step drawn log-uniformly in ``[0.001, 0.1]``; ``A``, ``D`` and ``delta_bias``
are float32 parameters, the rest in the benchmark's dtype.

What one call costs
-------------------
Scan, per element ``(b, d, t, n)`` of the ``(B, D, L, N)`` state, one FLOP per arithmetic
operation and one per transcendental::

    Δ·A                 1       exp(Δ·A) = Ā           1
    (Δ·u)·B[n] = B̄u     1       x = Ā·x + B̄u          2 (a multiply-add)
    y += x·C[n]         2 (a multiply-add)             7 per (b, d, t, n)

and per ``(b, d, t)``: ``Δ + bias`` (1), softplus ``log1p(exp(.))`` (2), ``Δ·u`` (1), ``y + D·u``
(2), ``silu(z) = z / (1 + exp(-z))`` (3), the gate's multiply (1): 10. So::

    scan_flops = B·D·L·(7·N + 10)                           (122 per channel-step at N = 16)

This is the work of the recurrence, not what each implementation executes: the parallel scan
does about ``log2 L`` combines (3 FLOPs each) per element instead of one, and the Triton kernel's
in-chunk tree about ``log2 CHUNK``. Bytes, the scan's ideal traffic: read ``u``, ``Δ``, ``z``, write
``out`` (``B·D·L`` elements each), read ``B`` and ``C`` (``B·N·L`` each) and the float32 parameters
``A`` ``(D, N)``, ``D`` and ``delta_bias`` ``(D,)``; never the state::

    scan_bytes = elem·(4·B·D·L + 2·B·N·L) + 4·(D·N + 2·D)

About 15 FLOPs a byte in bfloat16 (``122 / 8`` at ``N = 16``): near a GPU's float32 ridge point,
and float32 is what the scan's arithmetic runs in. The torch scans move ``(B, D, L, N)`` float32 tensors instead
(64 bytes per channel-step each at ``N = 16``, where the inputs are 8): that is the point of the
fused kernel. Attention: module 08's formulas (``llmu.flash.bench.fwd_flops`` and ``fwd_bytes``),
``2·B·H·L²·Dh`` FLOPs causal, ``H = D / Dh``.

Why the entry has no FLOP or byte formula
-----------------------------------------
The runner divides one entry-wide count by every provider's time. Here the providers run two
different algorithms (attention's FLOPs are ``2·L / (7·N + 10)`` times the scan's: 34 times at
``L = 2048``, 270 times at ``L = 16384``, for ``N = 16``), so any single count would give one
family a meaningless TFLOP/s. The entry therefore leaves ``flops`` and
``bytes`` unset: the runner's rows carry ``ms`` only, and time per call (and tokens per second,
``B·L / time``) is the comparison that means something across algorithms. :func:`add_costs`
fills in each row's own counts afterwards (``flops``, ``bytes``, ``tflops``, ``gbs``, the fractions
of peak against float32 for the scan, whose arithmetic is float32, and the dtype's for attention;
and ``tokens_per_s``), for a roofline or a GB/s plot of one family.

Sizes: on a GPU the paper's ``B = 1``, ``D = 1024``, ``N = 16`` at ``L = 512 .. 65536`` (the paper
goes on to 512k), attention as 16 heads of ``Dh = 64`` (the head dim is this entry's choice, the
common one of module 08); on a CPU ``D = 128``, ``Dh = 64``, ``L = 128 .. 1024``, small enough for the
torch providers to take milliseconds (there, without a fused scan, attention is the faster of the
two at every length: the torch scans are bound by the traffic of their ``(B, D, L, N)`` tensors).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from llmu.bench.peaks import dtype_name, peak_for
from llmu.bench.registry import Entry, Provider, register
from llmu.bench.runner import YOURS, throughput
from llmu.checks import require_size
from llmu.flash import bench as flash_bench, kernels as flash_kernels
from llmu.mamba import kernels, reference

__all__ = ["MAMBA_SELECTIVE_SCAN", "ScanInputs", "check_size", "scan_setup", "scan_flops", "scan_bytes",
           "attention_size", "attention_flops", "attention_bytes", "costs", "add_costs", "SCAN_PROVIDERS",
           "ATTENTION_PROVIDERS", "SEQUENTIAL_MAX_L", "PARALLEL_MAX_L", "SIZE_KEYS"]

MODULE = "13_mamba"
NAME = "mamba_selective_scan"

#: The keys of a size: batch, model width (scan channels), state size, sequence length, head dim.
SIZE_KEYS = ("B", "D", "N", "L", "Dh")

#: Longest sequences the slow torch scans are run at.
SEQUENTIAL_MAX_L = 2048
PARALLEL_MAX_L = 32768

SCAN_PROVIDERS = ("llmu triton", "torch parallel", "torch sequential")
ATTENTION_PROVIDERS = ("llmu flash", "torch sdpa")


def check_size(size) -> tuple[int, int, int, int, int]:
    """``(B, D, N, L, Dh)`` of a size dict, or ValueError/TypeError naming what is wrong."""
    require_size(size, SIZE_KEYS)
    if size["D"] % size["Dh"]:
        raise ValueError(f"size['D'] = {size['D']} must be a multiple of the head dim size['Dh'] = {size['Dh']} "
                         "(attention at the same width has D / Dh heads)")
    return tuple(size[key] for key in SIZE_KEYS)


# ----------------------------------------------------------------------------------------------
# Costs
# ----------------------------------------------------------------------------------------------


def scan_flops(size) -> float:
    """``B·D·L·(7·N + 10)``: the selective scan's arithmetic (module docstring)."""
    b, d, n, L, _ = check_size(size)
    return float(b * d * L * (7 * n + 10))


def scan_bytes(size, elem: int) -> float:
    """``elem·(4·B·D·L + 2·B·N·L) + 4·(D·N + 2·D)``: inputs read once, output written once, no state."""
    b, d, n, L, _ = check_size(size)
    return float(elem * (4 * b * d * L + 2 * b * n * L) + 4 * (d * n + 2 * d))


def attention_size(size) -> dict:
    """The size of module 08's attention entries at this width: ``H = Hkv = D / Dh`` heads, causal."""
    b, d, _, L, dh = check_size(size)
    return {"B": b, "H": d // dh, "Hkv": d // dh, "T": L, "D": dh, "causal": True}


def attention_flops(size) -> float:
    """Causal attention's ``2·B·H·L²·Dh`` (``llmu.flash.bench.fwd_flops``)."""
    return float(flash_bench.fwd_flops(attention_size(size)))


def attention_bytes(size, elem: int) -> float:
    """q, k, v read, the output and the float32 log-sum-exp written (``llmu.flash.bench.fwd_bytes``)."""
    return float(flash_bench.fwd_bytes(attention_size(size), elem))


def costs(provider: str, size, elem: int) -> tuple[float, float]:
    """``(flops, bytes)`` of one call of ``provider`` (a scan or an attention) at ``size``; the
    learner's kernel, ``"yours"``, is a scan."""
    if _is_scan(provider):
        return scan_flops(size), scan_bytes(size, elem)
    if provider in ATTENTION_PROVIDERS:
        return attention_flops(size), attention_bytes(size, elem)
    raise ValueError(f"provider must be one of {SCAN_PROVIDERS + (YOURS,) + ATTENTION_PROVIDERS}, got {provider!r}")


def _is_scan(provider: str) -> bool:
    return provider in SCAN_PROVIDERS or provider == YOURS


def add_costs(results):
    """Give each measured ``mamba_selective_scan`` row its own provider's costs; returns ``results``.

    ``results``: what ``llmu.bench.run`` returns (or a list of its rows). Every measured row of
    this entry gets ``flops``, ``bytes`` (:func:`costs`), ``tflops``, ``gbs``, ``frac_flops`` and
    ``frac_bw`` (against the GPU's float32 peak for the scan, whose arithmetic is float32, and the
    row's dtype for attention; None on a CPU) and ``tokens_per_s`` (``B·L`` per call). A learner's
    kernel (the ``"yours"`` row) counts as a scan. Other rows are left as they are.
    """
    rows = results.get("rows", []) if isinstance(results, Mapping) else results
    env = (results.get("environment") or {}) if isinstance(results, Mapping) else {}
    peak = peak_for(env.get("gpu_name"))
    for row in rows:
        if row.get("entry") != NAME or row.get("status") != "ok" or row.get("ms") is None:
            continue
        size, dtype = row["size"], row["dtype"]
        elem = torch.empty((), dtype=getattr(torch, dtype_name(dtype))).element_size()
        flops, nbytes = costs(row["provider"], size, elem)
        peak_dtype = "float32" if _is_scan(row["provider"]) else dtype
        row.update(flops=flops, bytes=nbytes, tokens_per_s=size["B"] * size["L"] / (row["ms"] * 1e-3))
        row.update(throughput(row["ms"], flops, nbytes, peak, peak_dtype))
    return results


# ----------------------------------------------------------------------------------------------
# Inputs and providers
# ----------------------------------------------------------------------------------------------


class ScanInputs(NamedTuple):
    """The inputs every provider takes: the scan's (``u``, ``delta``, ``z`` ``(B, D, L)``; ``A``
    ``(D, N)``; ``B``, ``C`` ``(B, N, L)``; ``D``, ``delta_bias`` ``(D,)``) and attention's ``q``,
    ``k``, ``v`` ``(B, D / Dh, L, Dh)``: the same batch of tokens at the same width."""

    u: torch.Tensor
    delta: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor
    z: torch.Tensor
    delta_bias: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def scan_setup(size, device, dtype, seed: int = 0) -> ScanInputs:
    """The entry's ``setup``: seeded inputs drawn on ``device`` (module docstring for the values)."""
    b, d, n, L, dh = check_size(size)
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, dt=dtype):
        return torch.randn(shape, generator=g, device=device, dtype=dt).mul_(scale)

    A = -torch.arange(1, n + 1, device=device, dtype=torch.float32).repeat(d, 1)
    # Mamba's dt init: a step log-uniform in [1e-3, 1e-1]; delta_bias is its inverse softplus.
    log_dt = torch.rand(d, generator=g, device=device) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
    dt = log_dt.exp()
    delta_bias = dt + torch.log(-torch.expm1(-dt))
    scan = dict(u=randn(b, d, L), delta=randn(b, d, L, scale=0.5), A=A, B=randn(b, n, L), C=randn(b, n, L),
                D=torch.ones(d, device=device), z=randn(b, d, L), delta_bias=delta_bias)
    heads = d // dh
    q, k, v = (randn(b, heads, L, dh) for _ in range(3))
    return ScanInputs(**scan, q=q, k=k, v=v)


def _refuse_above(L: int, limit: int, what: str) -> None:
    if L > limit:
        raise ValueError(f"{what} is not run above L={limit} (too slow or too big; see llmu.mamba.bench), got L={L}")


# The setup's A is negative by construction: the providers skip the check of A's values, a read back
# to the host (a wait for the GPU) that is part of a call's cost but not of the scan measured here.


def scan_triton(u, delta, A, B, C, D, z, delta_bias, *_):
    return kernels.selective_scan_triton(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True, check_values=False)


def scan_parallel(u, delta, A, B, C, D, z, delta_bias, *_):
    _refuse_above(u.shape[-1], PARALLEL_MAX_L, "the torch parallel scan")
    return reference.selective_scan_parallel(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True,
                                             check_values=False)


def scan_sequential(u, delta, A, B, C, D, z, delta_bias, *_):
    _refuse_above(u.shape[-1], SEQUENTIAL_MAX_L, "the torch sequential scan (a Python loop over L)")
    return reference.selective_scan_sequential(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True,
                                               check_values=False)


def attention_flash(*inputs):
    q, k, v = inputs[-3:]
    return flash_kernels.flash_attention(q, k, v, causal=True)


def attention_sdpa(*inputs):
    q, k, v = inputs[-3:]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


MAMBA_SELECTIVE_SCAN = register(
    Entry(
        name=NAME,
        module=MODULE,
        description="selective scan forward (Mamba, state N=16) vs causal attention at the same width, against "
                    "sequence length; ms per call (the two algorithms' FLOPs differ: see llmu.mamba.bench)",
        providers={
            "llmu triton": Provider(scan_triton, "triton", "scan: llmu Triton"),
            "torch parallel": Provider(scan_parallel, "torch", "scan: torch parallel"),
            "torch sequential": Provider(scan_sequential, "torch", "scan: torch sequential"),
            "llmu flash": Provider(attention_flash, "triton", "attention: llmu flash"),
            "torch sdpa": Provider(attention_sdpa, "builtin", "attention: torch sdpa"),
        },
        setup=scan_setup,
        flops=None,
        bytes=None,
        gpu_sizes=[{"B": 1, "D": 1024, "N": 16, "L": L, "Dh": 64} for L in (512, 1024, 2048, 4096, 8192, 16384,
                                                                         32768, 65536)],
        cpu_sizes=[{"B": 1, "D": 128, "N": 16, "L": L, "Dh": 64} for L in (128, 256, 512, 1024)],
        x_axis="L",
    )
)
