"""Benchmark entry of module 04: the LM head's matmul and the cross-entropy, forward + backward.

One call takes hidden states ``x`` ``(N, H)``, the LM head ``W`` ``(V, H)`` and targets ``y``
``(N,)``, computes ``loss = cross_entropy(x @ W^T, y)`` (mean over the tokens) and its gradients
``dx``, ``dW``: the last step of every training step of a language model.

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.bench.registry import Entry, Provider, register
from llmu.checks import require_size
from llmu.training import cross_entropy, kernels

__all__ = ["FUSED_LINEAR_CROSS_ENTROPY", "setup", "flops", "bytes_moved", "SIZE_KEYS"]

MODULE = "04_training"
SIZE_KEYS = ("N", "H", "V")


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


def _with_grads(loss_fn):
    def run(x, w, y):
        loss = loss_fn(x, w, y)
        return (loss,) + torch.autograd.grad(loss, (x, w))
    run.__name__ = getattr(loss_fn, "__name__", "run")
    return run


def _naive(x, w, y):
    return F.cross_entropy((x @ w.T).float(), y)


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
        gpu_sizes=[{"N": n, "H": 576, "V": 49152} for n in (2048, 4096, 8192, 16384, 32768)],
        cpu_sizes=[{"N": n, "H": 64, "V": 4096} for n in (128, 256, 512)],
        x_axis="N",
    )
)
