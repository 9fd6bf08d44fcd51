"""Benchmark entries of module 04: the LM head's matmul and the cross-entropy, forward + backward,
and the forward pass alone.

``fused_linear_cross_entropy``: one call takes hidden states ``x`` ``(N, H)``, the LM head ``W``
``(V, H)`` and targets ``y`` ``(N,)``, computes ``loss = cross_entropy(x @ W^T, y)`` (mean over the
tokens) and its gradients ``dx``, ``dW``: the last step of every training step of a language model.

FLOPs: the logits ``x @ W^T`` are ``2·N·H·V``; the backward's ``dx = dz @ W`` and
``dW = dz^T @ x`` are ``2·N·H·V`` each: ``6·N·H·V`` in all. The softmax's exponentials (``N·V``)
are not counted, and neither is the recomputation of the logits that the chunked providers do in
backward (``2·N·H·V`` more work for the same result: it shows up as a lower TFLOP/s, the price of
never storing the logits).

Bytes: ``elem·(N·H + V·H) + 8·N``, reading ``x``, ``W`` and the int64 targets once: the least
traffic any implementation can have (writing ``dx`` and ``dW`` would add ``elem·(N + V)·H``
more). The naive provider also writes and reads the ``(N, V)`` logits, their float32
log-softmax and their gradient, ``N·V·(elem + 8)`` bytes and more: at SmolLM2's ``V = 49152`` and
``N = 8192`` that is 4.0 GB in bfloat16 against 66 MB for ``x`` and ``W``, which is what the
fused kernel saves (in memory, :func:`llmu.training.cross_entropy.memory_bytes`, and in traffic).

Providers: ``llmu triton`` (``kernels.fused_linear_cross_entropy``), ``llmu torch``
(``cross_entropy.chunked_cross_entropy``: Python loops over tiles; it shows the algorithm, not
speed) and ``torch naive`` (``F.cross_entropy(x @ W.T, y)`` and autograd). Sizes: SmolLM2-135M's
LM head (``H = 576``, ``V = 49152``) at 2k to 32k tokens on a GPU; a small head on the CPU.

``fused_linear_cross_entropy_fwd``: the forward pass alone, no gradient: what the notebook's
exercise 2 kernel computes, so that a learner's kernel can be timed beside llmu's. Same inputs and
sizes. The ``llmu triton`` provider runs llmu's forward kernel (``kernels.flce_forward``) and
returns what the notebook's launcher returns, ``(mean loss, lse of every row)``; ``llmu torch``
(``chunked_cross_entropy``) and ``torch naive`` (``F.cross_entropy(x @ W.T, y)``) return the loss.

FLOPs: ``2·N·H·V``, the logits ``x @ W^T``; the exponentials are not counted. Bytes:
``elem·(N·H + V·H) + 8·N + 8·N``: ``x``, ``W`` and the int64 targets read once, and the float32
``lse`` and row losses written (4 bytes each per row). The naive provider writes and reads the
``(N, V)`` logits on top, as above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.bench.registry import Entry, Provider, register
from llmu.checks import require_size
from llmu.training import cross_entropy, kernels

__all__ = ["FUSED_LINEAR_CROSS_ENTROPY", "FUSED_LINEAR_CROSS_ENTROPY_FORWARD", "setup", "setup_forward", "flops",
           "bytes_moved", "forward_flops", "forward_bytes", "SIZE_KEYS"]

MODULE = "04_training"
SIZE_KEYS = ("N", "H", "V")
IGNORE_INDEX = -100
GPU_SIZES = [{"N": n, "H": 576, "V": 49152} for n in (2048, 4096, 8192, 16384, 32768)]
CPU_SIZES = [{"N": n, "H": 64, "V": 4096} for n in (128, 256, 512)]


def setup(size, device, dtype):
    """``(x, W, y)``: unit-variance hidden states, an ``nn.Linear``-scaled head (O(1) logits), random targets."""
    n, h, v = require_size(size, SIZE_KEYS)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, h, generator=g, device="cpu").to(device=device, dtype=dtype).requires_grad_(True)
    w = (torch.randn(v, h, generator=g, device="cpu") * h ** -0.5).to(device=device, dtype=dtype).requires_grad_(True)
    y = torch.randint(0, v, (n,), generator=g, device="cpu").to(device)
    return x, w, y


def flops(size) -> float:
    """``6·N·H·V``: the logits (forward), ``dx`` and ``dW`` (backward)."""
    n, h, v = require_size(size, SIZE_KEYS)
    return 6.0 * n * h * v


def bytes_moved(size, elem: int) -> float:
    """``elem·(N·H + V·H) + 8·N``: ``x``, ``W`` and the int64 targets, each read once."""
    n, h, v = require_size(size, SIZE_KEYS)
    return float(elem * (n * h + v * h) + 8 * n)


def setup_forward(size, device, dtype):
    """``(x, W, y)`` of :func:`setup`, without ``requires_grad``: the forward pass alone records no graph."""
    x, w, y = setup(size, device, dtype)
    return x.detach(), w.detach(), y


def forward_flops(size) -> float:
    """``2·N·H·V``: the logits ``x @ W^T``."""
    n, h, v = require_size(size, SIZE_KEYS)
    return 2.0 * n * h * v


def forward_bytes(size, elem: int) -> float:
    """``elem·(N·H + V·H) + 8·N + 8·N``: ``x``, ``W`` and the int64 targets read once, the float32
    ``lse`` and row losses written."""
    n, h, v = require_size(size, SIZE_KEYS)
    return float(elem * (n * h + v * h) + 8 * n + 8 * n)


def _with_grads(loss_fn):
    def run(x, w, y):
        loss = loss_fn(x, w, y)
        return (loss,) + torch.autograd.grad(loss, (x, w))
    run.__name__ = getattr(loss_fn, "__name__", "run")
    return run


def _naive(x, w, y):
    return F.cross_entropy((x @ w.T).float(), y)


def _triton_forward(x, w, y):
    """llmu's forward kernel alone: ``(mean loss, lse of every row)``, as the notebook's launcher returns them."""
    lse, row_loss = kernels.flce_forward(x, w, y, IGNORE_INDEX, 0.0, kernels.default_blocks())
    return cross_entropy.reduce_rows(row_loss, y, IGNORE_INDEX, "mean"), lse


FUSED_LINEAR_CROSS_ENTROPY = register(
    Entry(
        name="fused_linear_cross_entropy",
        module=MODULE,
        description="LM head + cross-entropy, forward + backward (dx, dW): SmolLM2-135M's head (H=576, V=49152)",
        providers={
            "llmu triton": Provider(_with_grads(kernels.fused_linear_cross_entropy), "triton",
                                    "llmu fused linear cross-entropy (Triton)"),
            "llmu torch": Provider(_with_grads(cross_entropy.chunked_cross_entropy), "torch",
                                   "llmu chunked cross-entropy (torch tiles)"),
            "torch naive": Provider(_with_grads(_naive), "builtin", "F.cross_entropy(x @ W.T, y) + autograd"),
        },
        setup=setup,
        flops=flops,
        bytes=bytes_moved,
        gpu_sizes=GPU_SIZES,
        cpu_sizes=CPU_SIZES,
        x_axis="N",
    )
)

FUSED_LINEAR_CROSS_ENTROPY_FORWARD = register(
    Entry(
        name="fused_linear_cross_entropy_fwd",
        module=MODULE,
        description="LM head + cross-entropy, forward only (the loss and each row's lse): SmolLM2-135M's head "
                    "(H=576, V=49152)",
        providers={
            "llmu triton": Provider(_triton_forward, "triton", "llmu fused linear cross-entropy forward (Triton)"),
            "llmu torch": Provider(cross_entropy.chunked_cross_entropy, "torch",
                                   "llmu chunked cross-entropy (torch tiles)"),
            "torch naive": Provider(_naive, "builtin", "F.cross_entropy(x @ W.T, y)"),
        },
        setup=setup_forward,
        flops=forward_flops,
        bytes=forward_bytes,
        gpu_sizes=GPU_SIZES,
        cpu_sizes=CPU_SIZES,
        x_axis="N",
    )
)
