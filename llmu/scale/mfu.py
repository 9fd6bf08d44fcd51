"""Model FLOPs utilization (MFU): how much of the hardware's peak a training run turns into model math.

.. math::  \\text{MFU} = \\frac{\\text{model FLOPs per step} / \\text{step time}}{\\text{peak FLOP/s}}

**Model FLOPs** are the FLOPs the model *needs*: ``6·N`` per token plus attention
(``llmu.scale.flops.train_step_flops``), whatever the implementation does. Chowdhery et al. (2022,
PaLM, appendix B) introduced the term to compare systems fairly. Its sibling, **hardware FLOPs
utilization (HFU)**, counts what the chips actually executed, including work done twice: with
activation checkpointing the forward pass runs again during the backward, ``8·N`` per token instead
of ``6·N``, so HFU rises while the run gets no faster. MFU does not reward recomputation, padding or
redundant work; that is why it is the figure to compare. (PaLM counts attention as
``12·n_layers·n_heads·head_dim·T`` per token, the full ``T x T`` matrix; this course counts the
causal half, ``llmu.scale.flops``: a convention to state next to any MFU.)

**Peak**: the dense peak of the chip in the run's dtype: the datasheet for GPUs
(``llmu.bench.peaks``), and for this machine's CPU the best rate of a large matmul measured by
``llmu.roofline.measure_machine`` (module 05): a CPU has no datasheet figure that torch reaches.

**A run measured here.** :func:`train_run` trains a small Llama-architecture decoder from
``llmu.models`` (byte-level: vocabulary 256, on the ``essays`` text of ``llmu.data``) with AdamW
for a few steps, and times each step (forward, loss, backward, optimizer). The first ``warmup``
steps pay for allocation and the optimizer's state and are left out; the median of the others is
the step time (a shared machine makes steps slower, never faster, and the median ignores the
worst). ``mfu = train_step_flops / median step time / peak``. What is not model math shows up as
lost utilization: the softmax, the norms, the optimizer's element-wise update, the framework's
overhead per op, and matmuls too small to reach the library's peak.

Published MFUs (:data:`PUBLISHED_MFU`): the runs of the PaLM paper's table 3, and Llama 3 405B
(Meta, "The Llama 3 herd of models", 2024, table 4).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmu.checks import require_positive
from llmu.models import LlamaConfig, make_trainable
from llmu.models.llama import LlamaModel
from llmu.scale.flops import train_step_flops
from llmu.training.loop import TokenWindows

__all__ = ["mfu", "mfu_from_steps", "PublishedMFU", "PUBLISHED_MFU", "TrainRun", "train_step", "train_run",
           "TRAIN_SIZES"]


def mfu(achieved_flops_per_s: float, peak_flops_per_s: float) -> float:
    """``achieved / peak``: both in FLOP/s (not TFLOP/s against FLOP/s)."""
    require_positive("achieved_flops_per_s", achieved_flops_per_s)
    require_positive("peak_flops_per_s", peak_flops_per_s)
    return achieved_flops_per_s / peak_flops_per_s


def mfu_from_steps(step_seconds, flops_per_step: float, peak_flops_per_s: float, warmup: int = 1) -> float:
    """MFU of a run from its measured step times: the median of the steps after the first
    ``warmup``, ``flops_per_step`` model FLOPs each, against ``peak_flops_per_s``."""
    times = [float(t) for t in step_seconds]
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if len(times) <= warmup:
        raise ValueError(f"need more than warmup={warmup} step times, got {len(times)}")
    if any(not t > 0 for t in times):
        raise ValueError("every step time must be positive")
    require_positive("flops_per_step", flops_per_step)
    return mfu(flops_per_step / statistics.median(times[warmup:]), peak_flops_per_s)


@dataclass(frozen=True)
class PublishedMFU:
    """A training run's MFU as its authors report it (``hfu``: hardware FLOPs utilization, if given)."""

    name: str
    params: float
    hardware: str
    mfu: float
    source: str
    hfu: float | None = None
    note: str = ""


PUBLISHED_MFU = [
    PublishedMFU("GPT-3", 175e9, "V100", 0.213, "Chowdhery et al. 2022 (PaLM), table 3"),
    PublishedMFU("Gopher", 280e9, "4096 TPU v3", 0.325, "Chowdhery et al. 2022 (PaLM), table 3"),
    PublishedMFU("MT-NLG", 530e9, "2240 A100", 0.302, "Chowdhery et al. 2022 (PaLM), table 3"),
    PublishedMFU("PaLM", 540e9, "6144 TPU v4", 0.462, "Chowdhery et al. 2022 (PaLM), table 3", hfu=0.578,
                 note="HFU includes the recomputed forward passes of rematerialization"),
    PublishedMFU("Llama 3 405B", 405e9, "8192 H100", 0.43, "Meta 2024, Llama 3 herd, table 4",
                 note="BF16, 430 TFLOP/s per GPU, sequence 8192"),
    PublishedMFU("Llama 3 405B", 405e9, "16384 H100", 0.41, "Meta 2024, Llama 3 herd, table 4",
                 note="BF16, 400 TFLOP/s per GPU, sequence 8192"),
    PublishedMFU("Llama 3 405B", 405e9, "16384 H100, context parallel", 0.38, "Meta 2024, Llama 3 herd, table 4",
                 note="BF16, 380 TFLOP/s per GPU, sequence 131072"),
]


# ----------------------------------------------------------------------------------------------
# A short training run on this machine
# ----------------------------------------------------------------------------------------------

#: Sizes of the byte-level model (``llmu.models.byte_llama_config``) the benchmark entry and the
#: notebook train: hidden width H, layers L (heads of 64 dims, SwiGLU width 8H/3 rounded to a
#: multiple of 64).
TRAIN_SIZES = {"tiny": {"H": 128, "L": 2}, "small": {"H": 256, "L": 4}, "medium": {"H": 384, "L": 6}}


@dataclass
class TrainRun:
    """What :func:`train_run` measured: one wall-clock time and one loss per step."""

    config: LlamaConfig
    batch: int
    seq_len: int
    step_seconds: list[float]
    losses: list[float]
    flops_per_step: int
    n_params: int
    warmup: int = 1
    threads: int = field(default_factory=torch.get_num_threads)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    @property
    def step_time(self) -> float:
        """Median seconds per step after the warm-up."""
        return statistics.median(self.step_seconds[self.warmup:])

    @property
    def achieved_flops(self) -> float:
        """Model FLOP/s: the step's model FLOPs over its median time (the MFU numerator)."""
        return self.flops_per_step / self.step_time

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time

    def mfu(self, peak_flops_per_s: float) -> float:
        return mfu(self.achieved_flops, peak_flops_per_s)


def train_step(model: LlamaModel, optimizer: torch.optim.Optimizer, window: torch.Tensor) -> torch.Tensor:
    """One step on ``window`` ``(B, T + 1)`` token ids: forward on the first ``T``, cross-entropy
    against the next token, backward, AdamW update. Returns the loss (a 0-d tensor)."""
    logits = model(window[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), window[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def train_run(config: LlamaConfig, batch: int = 8, seq_len: int = 256, steps: int = 8, warmup: int = 1,
              lr: float = 3e-3, seed: int = 0, text: str = "essays") -> TrainRun:
    """Train ``config`` for ``steps`` AdamW steps on ``batch`` random windows of ``seq_len`` bytes
    of ``llmu.data.text(text)`` and time every step (module docstring)."""
    require_positive("batch", batch, integer=True)
    require_positive("seq_len", seq_len, integer=True)
    require_positive("steps", steps, integer=True)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < steps:
        raise ValueError(f"warmup must be an int in [0, steps), got {warmup!r}")
    if config.vocab_size != 256:
        raise ValueError(f"train_run trains on bytes: config.vocab_size must be 256, got {config.vocab_size}")
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"seq_len ({seq_len}) exceeds config.max_position_embeddings "
                         f"({config.max_position_embeddings})")
    windows = TokenWindows.from_text(text, seq_len, seed)        # module 04's seeded data source
    model = make_trainable(config, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    seconds, losses = [], []
    for _ in range(steps):
        window = windows.sample(batch)
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, window)
        seconds.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return TrainRun(config=config, batch=batch, seq_len=seq_len, step_seconds=seconds, losses=losses,
                    flops_per_step=train_step_flops(config, batch, seq_len), n_params=model.num_parameters(),
                    warmup=warmup)
