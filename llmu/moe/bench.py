"""Benchmark entries of module 12: an MoE layer's experts on tokens grouped by expert, the whole layer,
and the row gather of its permute step.

An MoE layer routes each of ``T`` tokens to ``k`` of ``E`` experts, then runs every expert's
SwiGLU MLP on the rows routed to it. Once the ``T·k`` token copies are sorted by expert
(``llmu.moe.kernels.permute``), expert ``e`` owns the contiguous rows ``offsets[e]:offsets[e+1]``
of ``x_sorted`` ``(T·k, H)`` and the work is three *grouped* matmuls and an elementwise gate::

    gate = x_e W_gate[e]^T      (rows_e, F)
    up   = x_e W_up[e]^T        (rows_e, F)
    h    = silu(gate) * up      (rows_e, F)
    out  = h W_down[e]^T        (rows_e, H)

``moe_grouped_gemm`` and ``moe_grouped_gemm_fine`` time exactly that. Routing, permute and the
weighted combine move ``T·k·H`` elements each, small next to the matmuls (``llmu.moe.kernels``'s
napkin math); ``moe_layer`` includes them.

Providers, all on the same grouped rows:

- ``llmu triton``: ``grouped_gemm`` for each projection (one launch over all the ragged groups)
  and module 03's fused SwiGLU kernel: four launches whatever ``E`` is;
- ``torch loop``: one SwiGLU MLP per expert on its slice (``llmu.layers.reference.swiglu``), the
  layout of ``reference.moe_reference``: several launches per expert (three matmuls, the gate,
  the copy into place), each on a ragged, often small, matrix. The group bounds are read once
  at setup, so the loop never waits for the device;
- ``torch grouped_mm``: PyTorch's own grouped GEMM, ``torch._grouped_mm`` (a private operator of
  recent torch versions; on a GPU its fast path is bfloat16, on the CPU it runs float32 too), with
  ``llmu.layers.reference.silu_mul`` between the projections. Where torch lacks it, the row is
  skipped as "not installed".

Cost of one call, ``M = T·k`` grouped rows, ``elem`` bytes per element::

    flops = 3 · 2·M·H·F = 6·T·k·H·F       three matmuls of (M x H) by (H x F) or (M x F) by (F x H);
                                          the gate's 5 flops per element of h (sigmoid, two
                                          multiplies) add 5·M·F, under 0.1 % at H >= 4096: left out
    bytes = elem · (3·E·H·F               every expert's three matrices, read once (every expert
                                          gets rows at these sizes)
                    + 3·M·H               x_sorted read by the gate and by the up projection (two
                                          launches: two reads), the output written once
                    + 6·M·F)              gate and up written, then read by SwiGLU, h written, then
                                          read by the down projection

That is the least traffic of the structure all three providers share (three matmuls and a gate,
each reading its inputs once and writing its output once); what an implementation moves beyond
it (a torch temporary, a tile of ``x`` re-read from HBM) shows as a lower GB/s. A kernel fusing
the whole MLP, keeping ``gate``, ``up`` and ``h`` on chip, would move ``elem·(3·E·H·F + 2·M·H)``.
The intensity (FLOPs per byte, bfloat16) grows with ``T`` because the weights are read once
whatever the number of tokens: Mixtral's shape goes from 120 at ``T = 512`` (below an H200's
ridge point of about 200: memory-bound, the 2.8 GB of weights dominate) to 650 at ``T = 4096``
(``6·8192·4096·14336 = 2.9e12`` FLOPs) and 1250 at 16384, compute-bound, where the question is
whether one grouped launch keeps the tensor cores as busy as a loop of per-expert matmuls.
DeepSeek-V3's shape, 22.5 GB of weights for 8 small experts per token, stays memory-bound up to
``T = 4096`` (16 at ``T = 512``, 210 at 8192): there GB/s is the column that matters.

``moe_layer`` times the whole layer, ``x`` ``(T, H)`` in, ``y`` ``(T, H)`` out: the router
(logits, softmax, top-k, the auxiliary losses: ``reference.route``), grouping the copies by
expert, the experts, and the gate-weighted combine. Providers: ``llmu triton``
(``kernels.moe_triton``: the Triton permute, grouped GEMMs, SwiGLU and combine), ``torch loop``
(``reference.moe_reference``: per expert, find its tokens, gather, MLP, scatter-add; a host
synchronisation per expert to learn its row count), ``torch grouped_mm`` (the router and the
sort in torch, ``torch._grouped_mm`` for the experts, ``index_add`` for the combine). Its cost adds
to the experts' the router's ``(T, H) x (H, E)`` matmul and the combine's multiply-add per element
of each copy::

    flops = 2·T·H·E + 6·T·k·H·F + 2·T·k·H
    bytes = elem · (3·E·H·F + E·H            expert and router weights
                    + 2·T·H                  x read by the router, y written
                    + 6·T·k·H                the gather reads T·k rows of x and writes x_sorted, the
                                             experts read it twice and write their output, the
                                             combine reads that
                    + 6·T·k·F)               the experts' intermediates, as above

(the routing's own tensors, ``T·k`` ids and weights and ``T·E`` float32 logits, are well under one
percent of that and left out). Same sizes as ``moe_grouped_gemm``.

``moe_gather_rows`` times the copy of the permute step alone (exercise 4 of the notebook):
``x_sorted = x[src]`` with ``src = order // k`` ``(T·k,)`` int64, the token of each copy once the
copies are sorted by expert, for ``x`` ``(T, H)``. Providers: ``llmu triton``
(``kernels.gather_rows``, one program per tile of 16 rows and 128 columns) and
``torch index_select`` (``x.index_select(0, src)``: the rows of ``x[src]``). A copy does no
arithmetic, so the entry has no FLOP formula and its figure is in GB/s; its bytes, with
``M = T·k`` rows::

    bytes = elem·2·M·H       every output row reads one row of x and writes it (a token's row is
                             read once per copy, k times: the ideal traffic would read x once,
                             elem·(T·H + M·H), but the kernel issues one read per copy and leaves
                             any reuse to the cache)
            + 8·M            src, int64

At Mixtral's ``H = 4096`` and ``T = 4096`` in bfloat16 that is 134 MB, about 30 us at an H200's
4.8 TB/s (``llmu.moe.kernels``'s napkin math). Its sizes: Mixtral's ``k = 2`` of ``E = 8`` and
``H = 4096``, ``T = 512 .. 16384``, on a GPU; ``H = 512`` on a CPU. The rows are those of the seeded
router above: :func:`gather_setup` routes the same ``x`` as :func:`make_layer`.

Routing: a seeded router, ``softmax(x W_r^T)`` top-``k`` (``reference.top_k_route``), on tokens
``x = n + μ`` whose noise ``n`` is standard normal and whose mean ``μ`` (one vector shared by all
tokens, as real hidden states have) gives every expert a constant logit offset ``μ·w_e``
(standard deviation 0.2 against 1 for the token-dependent part). Groups are therefore uneven, as
in a real layer (some experts popular, some nearly idle): at the sizes below the largest group
holds 1.2 to 1.6 times the mean with 8 experts, 2 to 4 times with 64 or 256 (where top-8 of 256
also has sampling noise: 16 rows per expert on average at ``T = 512``). :func:`make_layer` hands
the same ``x`` and ``W_r`` to ``reference.moe_reference``, which takes the same decisions (the
tests check it).

Sizes. ``moe_grouped_gemm``: Mixtral-8x7B's experts (``H = 4096``, ``F = 14336``, ``E = 8``,
``k = 2``; the model's ``config.json``: hidden_size, intermediate_size, num_local_experts,
num_experts_per_tok) at ``T = 512 .. 16384`` tokens: few, large groups. ``moe_grouped_gemm_fine``:
DeepSeek-V3's routed experts (``H = 7168``, ``F = 2048`` = moe_intermediate_size, ``E = 256``
n_routed_experts, ``k = 8`` num_experts_per_tok; the shared expert is a plain MLP and left out),
fine-grained: many small groups, 16 rows per expert on average at ``T = 512``; its weights are
22.5 GB in bfloat16, so its GPU sizes stop at ``T = 8192``. Two entries rather than one so that
each figure has one line per provider against ``T``. CPU sizes: the same kinds of shape
(``E = 8, k = 2`` and ``E = 64, k = 8``), scaled down until the torch providers take milliseconds
in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmu.bench.registry import Entry, Provider, register
from llmu.checks import require_size
from llmu.layers.reference import silu_mul, swiglu
from llmu.layers.swiglu import swiglu_fused
from llmu.moe import kernels, reference

__all__ = ["MOE_GROUPED_GEMM", "MOE_GROUPED_GEMM_FINE", "MOE_LAYER", "MOE_GATHER_ROWS", "GroupedExperts",
           "make_layer", "grouped_setup", "layer_setup", "gather_setup", "check_size", "check_gather_size",
           "experts_flops", "experts_bytes", "layer_flops", "layer_bytes", "gather_bytes", "experts_triton",
           "experts_loop", "experts_grouped_mm", "layer_triton", "layer_loop", "layer_grouped_mm",
           "gather_torch", "SIZE_KEYS", "GATHER_SIZE_KEYS"]

MODULE = "12_mixture_of_experts"

#: The keys of a size: tokens, experts per token, experts, hidden width, expert width.
SIZE_KEYS = ("T", "k", "E", "H", "F")

#: The keys of a ``moe_gather_rows`` size: the same without the expert width (a copy has no experts' work).
GATHER_SIZE_KEYS = ("T", "k", "E", "H")

#: Standard deviation of the per-expert logit offset ``μ·w_e`` (the token-dependent part has 1).
ROUTER_SKEW = 0.2


def check_size(size, keys: tuple[str, ...] = SIZE_KEYS) -> tuple[int, ...]:
    """The values of ``keys`` in a size dict, ``(T, k, E, H, F)`` by default, or ValueError/TypeError naming
    what is wrong."""
    require_size(size, keys)
    if size["k"] > size["E"]:
        raise ValueError(f"size['k'] (experts per token) must be at most size['E'] = {size['E']}, got {size['k']}")
    return tuple(size[key] for key in keys)


def check_gather_size(size) -> tuple[int, int, int, int]:
    """``(T, k, E, H)`` of a ``moe_gather_rows`` size dict, or ValueError/TypeError naming what is wrong."""
    return check_size(size, GATHER_SIZE_KEYS)


def experts_flops(size) -> float:
    """``6·T·k·H·F``: the three projections of every token copy (module docstring)."""
    t, k, _, h, f = check_size(size)
    return 6.0 * t * k * h * f


def experts_bytes(size, elem: int) -> float:
    """``elem·(3·E·H·F + 3·T·k·H + 6·T·k·F)``: weights once, activations as the module docstring counts."""
    t, k, e, h, f = check_size(size)
    m = t * k
    return float(elem * (3 * e * h * f + 3 * m * h + 6 * m * f))


def layer_flops(size) -> float:
    """``2·T·H·E + 6·T·k·H·F + 2·T·k·H``: router, experts, combine (module docstring)."""
    t, k, e, h, _ = check_size(size)
    return 2.0 * t * h * e + experts_flops(size) + 2.0 * t * k * h


def layer_bytes(size, elem: int) -> float:
    """``elem·(3·E·H·F + E·H + 2·T·H + 6·T·k·H + 6·T·k·F)`` (module docstring)."""
    t, k, e, h, f = check_size(size)
    m = t * k
    return float(elem * (3 * e * h * f + e * h + 2 * t * h + 6 * m * h + 6 * m * f))


def gather_bytes(size, elem: int) -> float:
    """``elem·2·T·k·H + 8·T·k``: each copy's row of x read and written, its int64 source index read."""
    t, k, _, h = check_gather_size(size)
    m = t * k
    return float(elem * 2 * m * h + 8 * m)


# ----------------------------------------------------------------------------------------------
# Inputs: a seeded router, then the token copies sorted by expert
# ----------------------------------------------------------------------------------------------


def make_layer(size, device="cpu", dtype=torch.float32, seed: int = 0) -> dict:
    """An MoE layer's inputs for ``size``, made on ``device`` (weights drawn there: no host copy).

    Returns ``x`` ``(T, H)``, ``router_weight`` ``(E, H)``, ``w_gate``, ``w_up`` ``(E, F, H)``,
    ``w_down`` ``(E, H, F)`` (``nn.Linear``-like scales, so activations stay of order one) and the
    routing: ``experts``, ``weights`` ``(T, k)`` from ``reference.top_k_route`` on float32 logits,
    exactly what ``reference.moe_reference(x, router_weight, ..., k)`` decides.
    """
    _, k, e, h, f = check_size(size)
    randn, x, router_weight = _tokens_and_router(size, device, dtype, seed)
    layer = dict(x=x, router_weight=router_weight,
                 w_gate=randn(e, f, h, scale=h ** -0.5), w_up=randn(e, f, h, scale=h ** -0.5),
                 w_down=randn(e, h, f, scale=f ** -0.5))
    aux = reference.route(x, router_weight, k)   # the reference's own router: the same decisions
    layer.update(experts=aux.experts, weights=aux.weights)
    return layer


def _tokens_and_router(size, device, dtype, seed: int):
    """The first draws of :func:`make_layer`: its ``randn`` (for the draws that follow), ``x`` ``(T, H)`` and
    ``W_r`` ``(E, H)``."""
    t, e, h = size["T"], size["E"], size["H"]
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=dtype):  # drawn in the target dtype: no float32 copy of 22 GB
        return torch.randn(shape, generator=g, device=device, dtype=dtype).mul_(scale)

    # Tokens share a mean direction mu: mu . w_e is a constant offset per expert, so loads are uneven.
    mu = randn(h, scale=ROUTER_SKEW, dtype=torch.float32)
    x = (randn(t, h, dtype=torch.float32) + mu).to(dtype)
    return randn, x, randn(e, h, scale=h ** -0.5)


class GroupedExperts(NamedTuple):
    """The inputs every provider takes: ``x_sorted`` ``(T·k, H)`` (rows grouped by expert), the
    stacked weights, ``offsets`` ``(E+1,)`` int64 on the device, ``bounds`` the same as Python ints
    (for the loop) and ``ends`` ``offsets[1:]`` as int32 (``torch._grouped_mm``'s ``offs``)."""

    x_sorted: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    offsets: torch.Tensor
    bounds: tuple[int, ...]
    ends: torch.Tensor


def grouped_setup(size, device, dtype) -> GroupedExperts:
    """The entries' ``setup``: :func:`make_layer`, then the copies sorted by expert (``kernels.sort_by_expert``,
    a counting sort in torch; the rows gathered with torch indexing: setup is not timed)."""
    layer = make_layer(size, device, dtype)
    order, _, offsets = kernels.sort_by_expert(layer["experts"], size["E"])
    x_sorted = layer["x"][order // size["k"]]
    return GroupedExperts(x_sorted, layer["w_gate"], layer["w_up"], layer["w_down"], offsets,
                          tuple(offsets.tolist()), offsets[1:].to(torch.int32))


def gather_setup(size, device, dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_gather_rows``'s ``setup``: ``(x, src)``, ``x`` ``(T, H)`` and ``src = order // k`` ``(T·k,)``
    int64, the token of each copy sorted by expert, as :func:`make_layer`'s router sends them (no
    expert weights are drawn)."""
    _, k, e, _ = check_gather_size(size)
    _, x, router_weight = _tokens_and_router(size, device, dtype, seed)
    order, _, _ = kernels.sort_by_expert(reference.route(x, router_weight, k).experts, e)
    return x, order // k


def layer_setup(size, device, dtype) -> tuple:
    """``moe_layer``'s ``setup``: ``(x, router_weight, w_gate, w_up, w_down, k)`` of :func:`make_layer`."""
    layer = make_layer(size, device, dtype)
    return tuple(layer[name] for name in ("x", "router_weight", "w_gate", "w_up", "w_down")) + (size["k"],)


# ----------------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------------


def experts_triton(x_sorted, w_gate, w_up, w_down, offsets, bounds=None, ends=None):
    """Three ``grouped_gemm`` launches and the fused SwiGLU kernel."""
    h = swiglu_fused(kernels.grouped_gemm(x_sorted, w_gate, offsets), kernels.grouped_gemm(x_sorted, w_up, offsets))
    return kernels.grouped_gemm(h, w_down, offsets)


def experts_loop(x_sorted, w_gate, w_up, w_down, offsets, bounds, ends=None):
    """One SwiGLU MLP per expert on its rows ``bounds[e]:bounds[e+1]`` (experts without rows skipped)."""
    out = x_sorted.new_empty((x_sorted.shape[0], w_down.shape[1]))
    for e in range(w_gate.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = swiglu(x_sorted[lo:hi], w_gate[e], w_up[e], w_down[e])
    return out


def _builtin_grouped_mm():
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:  # the runner records an ImportError as "skipped: not installed"
        raise ImportError(f"torch._grouped_mm is not in torch {torch.__version__} "
                          "(a private operator of recent versions)")
    return grouped_mm


def experts_grouped_mm(x_sorted, w_gate, w_up, w_down, offsets, bounds, ends):
    """``torch._grouped_mm`` for each projection. It computes ``x_g @ w[g]`` with ``w`` ``(E, K, N)``:
    the ``(E, N, K)`` weights go in as their transposed views, the layout its GPU path prefers."""
    grouped_mm = _builtin_grouped_mm()
    gate = grouped_mm(x_sorted, w_gate.transpose(1, 2), offs=ends)
    up = grouped_mm(x_sorted, w_up.transpose(1, 2), offs=ends)
    return grouped_mm(silu_mul(gate, up), w_down.transpose(1, 2), offs=ends)


def gather_torch(x, src):
    """``x[src]`` in PyTorch: ``index_select`` along the rows."""
    return x.index_select(0, src)


def layer_triton(x, router_weight, w_gate, w_up, w_down, k):
    return kernels.moe_triton(x, router_weight, w_gate, w_up, w_down, k)[0]


def layer_loop(x, router_weight, w_gate, w_up, w_down, k):
    return reference.moe_reference(x, router_weight, w_gate, w_up, w_down, k)[0]


def layer_grouped_mm(x, router_weight, w_gate, w_up, w_down, k):
    """The layer in torch around ``torch._grouped_mm``: route, sort by expert, gather, experts, combine."""
    _builtin_grouped_mm()
    aux = reference.route(x, router_weight, k)
    order, _, offsets = kernels.sort_by_expert(aux.experts, w_gate.shape[0])
    token = order // k
    out = experts_grouped_mm(x[token], w_gate, w_up, w_down, offsets, None, offsets[1:].to(torch.int32))
    weighted = out.float() * aux.weights.reshape(-1)[order, None]
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token, weighted).to(x.dtype)


PROVIDERS = {
    "llmu triton": Provider(experts_triton, "triton", "llmu grouped_gemm"),
    "torch loop": Provider(experts_loop, "torch", "torch loop over experts"),
    "torch grouped_mm": Provider(experts_grouped_mm, "builtin", "torch._grouped_mm"),
}


def _sizes(t_values, k, e, h, f):
    return [{"T": t, "k": k, "E": e, "H": h, "F": f} for t in t_values]


MOE_GROUPED_GEMM = register(
    Entry(
        name="moe_grouped_gemm",
        module=MODULE,
        description="an MoE layer's experts on tokens grouped by expert (gate, up, SwiGLU, down): "
                    "Mixtral-8x7B shapes (E=8, k=2, H=4096, F=14336), uneven groups from a seeded router",
        providers=dict(PROVIDERS),
        setup=grouped_setup,
        flops=experts_flops,
        bytes=experts_bytes,
        gpu_sizes=_sizes((512, 1024, 2048, 4096, 8192, 16384), k=2, e=8, h=4096, f=14336),
        cpu_sizes=_sizes((64, 128, 256, 512), k=2, e=8, h=256, f=512),
        x_axis="T",
    )
)

MOE_GROUPED_GEMM_FINE = register(
    Entry(
        name="moe_grouped_gemm_fine",
        module=MODULE,
        description="the same with fine-grained experts, many small groups: DeepSeek-V3's routed experts "
                    "(E=256, k=8, H=7168, F=2048)",
        providers=dict(PROVIDERS),
        setup=grouped_setup,
        flops=experts_flops,
        bytes=experts_bytes,
        gpu_sizes=_sizes((512, 1024, 2048, 4096, 8192), k=8, e=256, h=7168, f=2048),
        cpu_sizes=_sizes((64, 128, 256, 512), k=8, e=64, h=256, f=64),
        x_axis="T",
    )
)

MOE_LAYER = register(
    Entry(
        name="moe_layer",
        module=MODULE,
        description="a whole MoE layer, x in, y out (router, grouping by expert, experts, weighted combine): "
                    "Mixtral-8x7B shapes",
        providers={
            "llmu triton": Provider(layer_triton, "triton", "llmu moe_triton"),
            "torch loop": Provider(layer_loop, "torch", "moe_reference (loop)"),
            "torch grouped_mm": Provider(layer_grouped_mm, "builtin", "torch grouped_mm layer"),
        },
        setup=layer_setup,
        flops=layer_flops,
        bytes=layer_bytes,
        gpu_sizes=list(MOE_GROUPED_GEMM.gpu_sizes),
        cpu_sizes=list(MOE_GROUPED_GEMM.cpu_sizes),
        x_axis="T",
    )
)

MOE_GATHER_ROWS = register(
    Entry(
        name="moe_gather_rows",
        module=MODULE,
        description="the permute step's copy, x_sorted = x[order // k]: T·k rows of width H gathered into "
                    "expert order, Mixtral-8x7B shapes (k=2 of E=8, H=4096); GB/s (a copy has no FLOPs)",
        providers={
            "llmu triton": Provider(kernels.gather_rows, "triton", "llmu gather_rows"),
            "torch index_select": Provider(gather_torch, "builtin", "torch index_select"),
        },
        setup=gather_setup,
        flops=None,
        bytes=gather_bytes,
        gpu_sizes=[{"T": t, "k": 2, "E": 8, "H": 4096} for t in (512, 1024, 2048, 4096, 8192, 16384)],
        cpu_sizes=[{"T": t, "k": 2, "E": 8, "H": 512} for t in (256, 512, 1024, 2048)],
        x_axis="T",
    )
)
