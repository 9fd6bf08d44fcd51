"""Training a small Mamba and a same-size attention model on module 13's copying tasks, on a CPU.

Two models of about the same parameter count:

- :func:`mamba_model`: ``llmu.mamba.block.MambaLM`` (embedding, Mamba blocks, tied head), selective
  or, with ``selective=False``, the time-invariant ablation (a few hundred parameters fewer);
- :func:`attention_model`: the course's own Llama decoder (``llmu.models.LlamaModel``: RoPE,
  grouped-query attention, SwiGLU, RMSNorm, tied head) built from a small ``LlamaConfig``. That
  model is meant for loading checkpoints, so :class:`AttentionLM` builds it with
  ``llmu.models.make_trainable`` (fresh weights, normal with std 0.02, norm gains 1, gradients on).

:func:`train_copying` runs AdamW on fresh batches of a task from ``llmu.mamba.tasks`` (a new batch
every step, drawn from a seeded generator), with the loss on the answer positions only, and
records the loss and the answer accuracy of every step in a :class:`TrainingRun`. Everything is
seeded: with one thread, two runs with the same arguments give the same curves.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from llmu.mamba import tasks
from llmu.mamba.block import MambaLM
from llmu.models import LlamaConfig, make_trainable

__all__ = ["AttentionLM", "TrainingRun", "mamba_model", "attention_model", "num_parameters", "train_copying",
           "being_graded", "TASKS"]

#: The tasks :func:`train_copying` knows, by name.
TASKS = {"selective": tasks.selective_copying_batch, "copying": tasks.copying_batch}


class AttentionLM(nn.Module):
    """A trainable ``LlamaModel``: ``forward(ids)`` returns the logits ``(B, T, V)``."""

    def __init__(self, config: LlamaConfig, seed: int = 0):
        super().__init__()
        self.model = make_trainable(config, seed=seed)

    @property
    def config(self) -> LlamaConfig:
        return self.model.config

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def being_graded() -> bool:
    """True while grading code (``llmu grade``, a class's autograde) runs this process's notebook:
    ``LLMU_AUTOGRADING`` (:data:`llmu.runtime.AUTOGRADING_ENV`) is set and not ``0``.

    Notebook 13's experiment cell trains only when it is false: a graded notebook is scored on runs
    the test cell trains itself with the learner's classes, so training in the cell too would only
    double the time grading takes."""
    from llmu.runtime import AUTOGRADING_ENV

    return os.environ.get(AUTOGRADING_ENV, "").strip() not in ("", "0")


def num_parameters(model: nn.Module) -> int:
    """Trainable parameters, each tensor counted once (a tied head adds nothing)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.requires_grad and p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    return total


def mamba_model(vocab: int, d_model: int = 32, n_layers: int = 2, d_state: int = 8, seed: int = 0,
                selective: bool = True, block_class: type | None = None) -> MambaLM:
    """A small :class:`MambaLM` (expand 2, conv width 4), seeded. ``selective=False`` builds the
    time-invariant ablation (``Δ``, ``B``, ``C`` learnt but the same at every step, as in S4).

    ``block_class``: blocks of your own class in place of ``MambaBlock``, each built as
    ``block_class(d_model, d_state=..., d_conv=..., expand=...)`` and loading, with its
    ``load_from``, the initial weights of the ``MambaBlock`` it replaces (selective or not, as
    ``selective`` says): the same start as llmu's model with the same seed."""
    torch.manual_seed(seed)                            # MambaBlock draws its Δ initialisation from torch's RNG
    return MambaLM(vocab, d_model=d_model, n_layers=n_layers, d_state=d_state, selective=selective,
                   block_class=block_class)


def attention_model(vocab: int, d_model: int = 32, n_layers: int = 2, n_heads: int = 4,
                    intermediate_size: int | None = None, max_len: int = 512, seed: int = 0) -> AttentionLM:
    """A small Llama decoder (multi-head attention, ``n_heads`` heads of ``d_model / n_heads``).

    ``intermediate_size`` (the SwiGLU width) defaults to the width that brings the parameter count
    closest to :func:`mamba_model`'s with the same ``vocab``, ``d_model`` and ``n_layers``."""
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
    base = dict(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                num_key_value_heads=n_heads, max_position_embeddings=max_len, tie_word_embeddings=True,
                bos_token_id=None, eos_token_id=None, pad_token_id=None, rope_theta=10000.0)
    if intermediate_size is None:
        target = num_parameters(mamba_model(vocab, d_model, n_layers, seed=seed))
        without_mlp = LlamaConfig(**base, intermediate_size=1).num_parameters() - 3 * d_model * n_layers
        intermediate_size = max(1, round((target - without_mlp) / (3 * d_model * n_layers)))
    return AttentionLM(LlamaConfig(**base, intermediate_size=intermediate_size), seed=seed)


@dataclass
class TrainingRun:
    """The curves of one :func:`train_copying` run (one value per step)."""

    name: str
    params: int
    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    seconds: float = 0.0
    eval_accuracy: float = float("nan")   # on a fresh held-out batch after training

    def smoothed(self, values: str = "accuracy", window: int = 10) -> list[float]:
        """A running mean of the last ``window`` steps of ``loss`` or ``accuracy`` (for plotting)."""
        v = getattr(self, values)
        return [sum(v[max(0, i - window + 1): i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(v))]


def train_copying(model: nn.Module, *, task: str = "selective", context_len: int = 32, n_data: int = 4,
                  n_symbols: int = 8, steps: int = 300, batch: int = 32, lr: float = 3e-3, warmup: int = 20,
                  seed: int = 0, eval_batch: int = 256, name: str | None = None,
                  time_budget_s: float | None = None, threads: int | None = None) -> TrainingRun:
    """Train ``model`` (``ids -> logits``) on ``task`` (``"selective"`` or ``"copying"``).

    AdamW (weight decay 0.01 on matrices only), learning rate ``lr`` with ``warmup`` linear steps
    then cosine to a tenth, gradient norm clipped at 1. A fresh batch each step from a generator
    seeded with ``seed``; the evaluation batch comes from another seed (``seed + 10_000``), so it
    is data the model never trained on. ``time_budget_s`` stops early when it is exceeded (the
    curves are then shorter than ``steps``). ``threads``: torch's intra-op threads while it trains
    and evaluates, restored afterwards (``1`` makes a run reproducible bit for bit on any machine);
    ``None`` leaves torch's setting alone."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    for arg, value in dict(steps=steps, batch=batch, warmup=warmup + 1, eval_batch=eval_batch).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    if threads is not None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return train_copying(model, task=task, context_len=context_len, n_data=n_data, n_symbols=n_symbols,
                                 steps=steps, batch=batch, lr=lr, warmup=warmup, seed=seed, eval_batch=eval_batch,
                                 name=name, time_budget_s=time_budget_s)
        finally:
            torch.set_num_threads(before)
    make = TASKS[task]
    g = torch.Generator().manual_seed(seed)
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    run = TrainingRun(name or type(model).__name__, num_parameters(model))
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        data = make(batch, context_len, n_data, n_symbols, g)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        logits = model(data.inputs)
        loss = tasks.answer_loss(logits, data)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run.loss.append(loss.item())
        run.accuracy.append(tasks.answer_accuracy(logits, data))
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            break
    run.seconds = time.perf_counter() - start
    model.eval()
    held_out = make(eval_batch, context_len, n_data, n_symbols, seed + 10_000)
    with torch.no_grad():
        run.eval_accuracy = tasks.answer_accuracy(model(held_out.inputs), held_out)
    return run
