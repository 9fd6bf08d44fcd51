"""Benchmark entry of module 15: one training step of a small Llama, so ``llmu bench`` reports MFU.

``train_step``: one forward pass, cross-entropy, backward pass and AdamW update
(``llmu.scale.mfu.train_step``) of a byte-level ``llmu.models`` decoder of ``L`` layers, ``H``
wide (heads of 64 channels, SwiGLU width ``8H/3`` rounded up to a multiple of 64, vocabulary 256)
on ``B`` sequences of ``T`` tokens. Its cost is the step's **model FLOPs**
(``llmu.scale.flops.train_step_flops``)::

    flops = B·T · (6·N_matmul + 6·L·H·(T + 1))     matmuls, forward and backward, plus causal attention

so the runner's TFLOP/s column is the MFU numerator, and on a GPU its fraction of peak *is* the MFU
(against the dense bf16 tensor-core peak of ``llmu.bench.peaks``). Bytes are not counted: a training
step's traffic (activations saved for the backward, gradients, optimizer state) has no single
formula, and this entry is about compute. On a GPU the step runs in bfloat16 throughout (weights,
gradients and AdamW state), not in mixed precision with float32 master weights: a benchmark of the
math, not a recipe for training.

Sizes: on a GPU ``B = 8``, ``T = 1024``, ``L = 8`` layers and ``H`` from 512 to 4096 (1.6 B
parameters at 4096), so the matmuls grow from too small to keep the tensor cores busy to large
enough; on a CPU ``B = 4``, ``T = 128``, ``L = 2``, ``H`` from 128 to 384, a fraction of a second a step.
"""

from __future__ import annotations

import torch

from llmu.bench.registry import Entry, Provider, register
from llmu.checks import require_size
from llmu.models import byte_llama_config, make_trainable
from llmu.scale.flops import train_step_flops
from llmu.scale.mfu import train_step

__all__ = ["TRAIN_STEP", "SIZE_KEYS", "step_config", "step_flops", "step_setup", "step_adamw"]

MODULE = "15_scale"

#: The keys of a size: sequences per batch, tokens per sequence, hidden width, layers.
SIZE_KEYS = ("B", "T", "H", "L")


def step_config(size):
    """The ``LlamaConfig`` of a size (``llmu.models.byte_llama_config``), or ValueError/TypeError."""
    _, t, h, layers = require_size(size, SIZE_KEYS)
    if h % 64:
        raise ValueError(f"size['H'] must be a multiple of 64 (heads of 64 channels), got {h}")
    return byte_llama_config(h, layers, max_len=t)


def step_flops(size) -> float:
    """Model FLOPs of one step: ``B·T·(6·N_matmul + 6·L·H·(T + 1))`` (module docstring)."""
    return float(train_step_flops(step_config(size), size["B"], size["T"]))


def step_setup(size, device, dtype) -> tuple:
    """``(model, optimizer, window)``: a fresh seeded model in ``dtype`` on ``device``, its AdamW,
    and one batch ``(B, T + 1)`` of random byte ids (the values do not change the work)."""
    config = step_config(size)
    model = make_trainable(config, seed=0, device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    window = torch.randint(0, config.vocab_size, (size["B"], size["T"] + 1), generator=g).to(device)
    return model, optimizer, window


def step_adamw(model, optimizer, window):
    """One timed step: ``llmu.scale.mfu.train_step``."""
    return train_step(model, optimizer, window)


TRAIN_STEP = register(
    Entry(
        name="train_step",
        module=MODULE,
        description="one training step (forward, loss, backward, AdamW) of a byte-level llmu Llama, "
                    "L layers H wide: TFLOP/s of model FLOPs, the MFU numerator",
        providers={"torch AdamW": Provider(step_adamw, "torch", "llmu model + torch AdamW")},
        setup=step_setup,
        flops=step_flops,
        gpu_sizes=[{"B": 8, "T": 1024, "H": h, "L": 8} for h in (512, 1024, 2048, 4096)],
        cpu_sizes=[{"B": 4, "T": 128, "H": h, "L": 2} for h in (128, 256, 384)],
        x_axis="H",
    )
)
