"""The training loop of a causal language model, piece by piece.

One optimizer step of :class:`Trainer` does, in order:

1. **Data.** Draw ``batch_size`` random windows of ``seq_len + 1`` consecutive token ids from one
   long 1-D tensor (:class:`TokenWindows`, seeded). The model reads the first ``seq_len`` ids of a
   window and is scored on predicting the last ``seq_len`` (each the next id of its input).
2. **Gradient accumulation.** Split the batch into ``k = accum_steps`` micro-batches and run
   forward and backward on each in turn; ``.backward()`` *adds* to ``p.grad``. Each micro-batch's
   loss (a mean over its tokens) is multiplied by ``1/k`` first, so the sum of the ``k`` gradients
   is the gradient of the mean over the whole batch: the same step as one big batch, with the
   activation memory of a micro-batch. (Exact because every window has the same number of
   scored tokens; with masked or padded tokens the weights must follow the token counts.)
3. **Gradient clipping by global norm** (:func:`clip_grad_norm`). Treat all gradients as one
   vector ``g``; if ``‖g‖ > max_norm``, scale every gradient by ``max_norm / ‖g‖``. The direction
   is kept, only the length is capped, so one unlucky batch cannot throw the weights far. The norm
   *before* clipping is returned and logged: it is the best early warning of an unstable run.
4. **AdamW** (Loshchilov & Hutter, 2019). Per parameter, two running averages: ``m`` of the
   gradient and ``v`` of its square; the update is ``lr · m̂ / (√v̂ + ε)`` (hats: bias-corrected),
   plus *decoupled* weight decay ``lr · λ · w`` applied to the weight directly rather than added
   to the gradient (where Adam's per-coordinate scaling would distort it).
   **Which tensors decay** (:func:`adamw_param_groups`): matrices (``ndim >= 2``: the projections,
   the embedding, the LM head) do; vectors (``ndim < 2``: RMSNorm gains, biases) do not. Decay
   pulls a value towards 0; for a matrix that means "prefer small weights", but a norm gain of 0
   silences its channel and a bias of 0 is merely a different offset, so neither is regularized.
   **Memory**: ``m`` and ``v`` are float32 tensors the shape of the parameters, 8 bytes per
   parameter on top of the 4 of the weight and the 4 of its gradient
   (:func:`optimizer_state_memory`, :func:`adamw_state_bytes`): for SmolLM2-135M about 1.08 GB of
   optimizer state for 0.54 GB of weights.
5. **Learning rate**: linear warmup, then a cosine down to ``min_lr`` (:func:`warmup_cosine`).
   Early on, Adam's ``v`` estimates are poor and large steps are risky, so the rate climbs over
   ``warmup`` steps; afterwards it decays smoothly so the last steps settle into a minimum.
   Two conventions for the warmup's first step are in use (``warmup_start``, see
   :func:`warmup_cosine`): rate ``peak/warmup`` at step 0 (the default here) or rate 0 (nanoGPT).

Every step appends a :class:`StepLog` (loss, learning rate, gradient norm before clipping,
tokens per second) to ``Trainer.history``.

**Checkpoints that resume exactly.** :meth:`Trainer.save_checkpoint` stores everything the next
step depends on: the weights, AdamW's ``m``, ``v`` and step counts, the scheduler's position,
the step number, torch's global CPU random state and the data sampler's generator. A new
:class:`Trainer` (fresh weights, fresh optimizer) that loads the file and trains ``M`` more steps
ends with the very same bits as a run of ``N + M`` steps straight through (same device, same
thread count: a different number of threads may sum in a different order). Leave one of them
out and the run still "works", only differently: the data sampler restarts at the first batch,
or Adam restarts with ``m = v = 0`` and takes a large first step.

A small model to train: ``llmu.models`` describes a byte-level Llama (``byte_llama_config``) and
gives an ``llmu.models.LlamaModel`` fresh trainable weights (``make_trainable``):

>>> from llmu.models import byte_llama_config, make_trainable
>>> model = make_trainable(byte_llama_config(hidden=128, layers=2), seed=0)
>>> trainer = Trainer(model, TokenWindows.from_text("essays", seq_len=64), TrainConfig(total_steps=40))
>>> logs = trainer.train(40)    # the loss falls from ln 256 = 5.5 to about 2.6 (2 s on one CPU thread)
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmu.checks import require_int as _require_int, require_positive
from llmu.data import byte_tokens, text as shipped_text
from llmu.training.checkpoint import read_state, write_state

__all__ = ["WARMUP_STARTS", "warmup_cosine", "warmup_cosine_scheduler", "adamw_param_groups", "clip_grad_norm", "optimizer_update",
           "TokenWindows", "TrainConfig", "StepLog", "Trainer", "OptimizerMemory", "optimizer_state_memory", "adamw_state_bytes"]


# ----------------------------------------------------------------------------------------------
# Learning-rate schedule
# ----------------------------------------------------------------------------------------------

#: The two conventions for the first warmup step (:func:`warmup_cosine`).
WARMUP_STARTS = ("one", "zero")


def _check_schedule(warmup, total, peak_lr, min_lr, warmup_start: str = "one") -> None:
    _require_int("total", total, 1)
    _require_int("warmup", warmup, 0)
    if warmup > total:
        raise ValueError(f"warmup ({warmup}) must not exceed total ({total})")
    require_positive("peak_lr", peak_lr)
    if isinstance(min_lr, bool) or not isinstance(min_lr, (int, float)):
        raise TypeError(f"min_lr must be a number, got {min_lr!r}")
    if not 0 <= min_lr <= peak_lr:
        raise ValueError(f"min_lr must be in [0, peak_lr={peak_lr}], got {min_lr}")
    if warmup_start not in WARMUP_STARTS:
        raise ValueError(f"warmup_start must be one of {WARMUP_STARTS}, got {warmup_start!r}")



def warmup_cosine(step: int, warmup: int, total: int, peak_lr: float, min_lr: float = 0.0, *,
                  warmup_start: str = "one") -> float:
    """The learning rate of step ``step`` (counted from 0) of a ``total``-step run.

    - ``step < warmup``: linear warmup, by one of two conventions (``warmup_start``):

      ``"one"`` (the default): ``peak_lr · (step + 1) / warmup``. The first step already moves (a
      step at rate 0 would be wasted) and step ``warmup - 1`` reaches ``peak_lr``.
      ``"zero"``: ``peak_lr · step / warmup``, as in nanoGPT and Stanford's CS336. Step 0 runs at
      rate 0, and ``peak_lr`` is reached at step ``warmup``, by the cosine below.

      With ``warmup = 4``, ``peak_lr = 1``:

      ============== ====== ====== ====== ====== ======
      step            0      1      2      3      4
      ============== ====== ====== ====== ====== ======
      ``"one"``       0.25   0.50   0.75   1.00   1.00
      ``"zero"``      0.00   0.25   0.50   0.75   1.00
      ============== ====== ====== ====== ====== ======

    - ``warmup <= step <= total``: half a cosine from ``peak_lr`` down to ``min_lr``,
      ``min_lr + (peak_lr - min_lr) · (1 + cos(π · (step - warmup) / (total - warmup))) / 2``
      (the same under both conventions);
    - ``step > total``: ``min_lr`` (training past the plan keeps the final rate).
    """
    _check_schedule(warmup, total, peak_lr, min_lr, warmup_start)
    step = _require_int("step", step, 0)
    if step < warmup:
        return peak_lr * (step + (warmup_start == "one")) / warmup
    if step >= total:
        return float(min_lr)
    progress = (step - warmup) / (total - warmup)
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int,
                            min_lr_ratio: float = 0.1, *, warmup_start: str = "one"
                            ) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` that gives every parameter group :func:`warmup_cosine` of its own initial
    ``lr`` (the peak), ending at ``min_lr_ratio · peak``, with the warmup convention
    ``warmup_start``. Call ``.step()`` after each ``optimizer.step()``; its ``state_dict()`` holds
    the position (``last_epoch``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _check_schedule(warmup, total, 1.0, min_lr_ratio, warmup_start)

    def factor(step: int) -> float:            # the schedule with peak 1: LambdaLR multiplies by each group's lr
        return warmup_cosine(step, warmup, total, 1.0, min_lr_ratio, warmup_start=warmup_start)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------------------------------
# AdamW's parameter groups, gradient clipping, optimizer-state memory
# ----------------------------------------------------------------------------------------------

def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW parameter groups of ``model``'s trainable parameters: matrices (``ndim >= 2``)
    with ``weight_decay``, vectors (``ndim < 2``: norm gains, biases) without (module docstring).
    A tensor shared by two modules (a tied embedding and LM head) appears once."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
    decay, no_decay = [], []
    for p in model.parameters():               # .parameters() yields a shared tensor only once
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def clip_grad_norm(parameters, max_norm: float | None) -> float:
    """Scale the gradients of ``parameters`` in place so that their global L2 norm is at most
    ``max_norm`` (``None``: measure only); return the norm *before* clipping.

    The global norm is ``sqrt(Σ_p ‖grad_p‖²)``, over all tensors together. The scale factor is
    ``max_norm / (norm + 1e-6)``, capped at 1 (the ``1e-6`` guards a zero norm), as in
    ``torch.nn.utils.clip_grad_norm_``."""
    if max_norm is not None:
        require_positive("max_norm", max_norm)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    # the norm of the per-tensor norms is the norm of all entries as one vector
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))
    if max_norm is not None:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(scale.to(g.dtype))
    return float(norm)


def optimizer_update(optimizer: torch.optim.Optimizer, scheduler, parameters, clip_norm: float | None
                     ) -> tuple[float, float]:
    """The end of every training step, once the gradients are in: clip them by global norm, take
    the optimizer step at the current learning rate, advance the schedule. Returns the norm before
    clipping and the rate the step used (the scheduler then holds the next step's)."""
    grad_norm = clip_grad_norm(parameters, clip_norm)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    return grad_norm, lr


@dataclass(frozen=True)
class OptimizerMemory:
    """Bytes an optimizer's state takes, measured from its state tensors (:func:`optimizer_state_memory`).

    ``exp_avg_bytes``/``exp_avg_sq_bytes``: AdamW's ``m`` and ``v``; ``other_bytes``: everything
    else (AdamW's per-tensor step counters: one 4-byte scalar per parameter tensor, not per value).
    """

    n_params: int
    exp_avg_bytes: int
    exp_avg_sq_bytes: int
    other_bytes: int

    @property
    def moment_bytes(self) -> int:
        """``m`` and ``v`` together."""
        return self.exp_avg_bytes + self.exp_avg_sq_bytes

    @property
    def bytes_per_param(self) -> float:
        """``m`` and ``v`` bytes per parameter: 8 with float32 state."""
        return self.moment_bytes / self.n_params if self.n_params else 0.0


def optimizer_state_memory(optimizer: torch.optim.Optimizer) -> OptimizerMemory:
    """Measure ``optimizer``'s state: ``numel · element_size`` of every state tensor, by kind.

    PyTorch creates the state lazily, at a parameter's first ``step()``: before it, every count
    is 0. ``n_params`` counts the values of all parameters the optimizer holds."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    n_params = exp_avg = exp_avg_sq = other = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            n_params += p.numel()
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                size = value.numel() * value.element_size()
                if key == "exp_avg":
                    exp_avg += size
                elif key == "exp_avg_sq":
                    exp_avg_sq += size
                else:
                    other += size
    return OptimizerMemory(n_params, exp_avg, exp_avg_sq, other)


def adamw_state_bytes(n_params: int, dtype: torch.dtype = torch.float32) -> int:
    """The formula: two moments per parameter value, ``2 · n_params · bytes(dtype)`` (8 bytes a
    parameter in float32)."""
    n_params = _require_int("n_params", n_params, 0)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return 2 * n_params * torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------------------------------
# Data: random windows of a token stream
# ----------------------------------------------------------------------------------------------

class TokenWindows:
    """Random windows of ``seq_len + 1`` consecutive ids from a 1-D tensor of token ids.

    A window starts anywhere from 0 to ``len(tokens) - seq_len - 1``, drawn uniformly by this
    object's own ``torch.Generator`` (seeded with ``seed``), so the stream of batches depends on
    nothing else. ``state_dict()`` / ``load_state_dict()`` save and restore the generator: a
    restored sampler continues with the batch the saved one would have drawn next.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int = 0):
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"tokens must be a torch.Tensor of token ids, got {type(tokens).__name__}")
        if tokens.ndim != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be a 1-D integer tensor, got shape {tuple(tokens.shape)} {tokens.dtype}")
        self.seq_len = _require_int("seq_len", seq_len, 1)
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"tokens holds {tokens.numel()} ids: too few for one window of "
                             f"seq_len + 1 = {seq_len + 1}")
        self.tokens = tokens.to(torch.int64)
        self.seed = _require_int("seed", seed, 0)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.windows_drawn = 0

    @classmethod
    def from_text(cls, name: str = "essays", seq_len: int = 64, seed: int = 0) -> TokenWindows:
        """Windows of the UTF-8 bytes of ``llmu.data.text(name)`` (ids 0..255: a byte-level model)."""
        return cls(byte_tokens(shipped_text(name)), seq_len, seed)

    def sample(self, n: int) -> torch.Tensor:
        """``n`` windows, an int64 tensor ``(n, seq_len + 1)``."""
        n = _require_int("n", n, 1)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (n,), generator=self.generator)
        self.windows_drawn += n
        return self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "windows_drawn": self.windows_drawn, "seed": self.seed,
                "seq_len": self.seq_len, "n_tokens": self.tokens.numel()}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seq_len", "n_tokens"):
            mine = self.seq_len if key == "seq_len" else self.tokens.numel()
            if state[key] != mine:
                raise ValueError(f"the saved sampler had {key}={state[key]}, this one has {mine}: "
                                 "a different token stream cannot continue it")
        self.generator.set_state(state["generator"])
        self.windows_drawn, self.seed = state["windows_drawn"], state["seed"]


# ----------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainConfig:
    """The hyperparameters of a :class:`Trainer` run.

    ``batch_size`` windows per optimizer step, processed as ``accum_steps`` micro-batches of
    ``batch_size / accum_steps`` (it must divide): the steps are the same for any ``accum_steps``,
    only the activation memory changes. ``clip_norm=None`` measures the gradient norm without
    clipping. The defaults (betas 0.9/0.95, decay 0.1, clip 1.0, min_lr = peak/10) are those of
    GPT-3 and Llama pretraining."""

    total_steps: int = 100
    batch_size: int = 8
    accum_steps: int = 1
    peak_lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 10
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip_norm: float | None = 1.0

    def __post_init__(self):
        _check_schedule(self.warmup, self.total_steps, self.peak_lr, self.min_lr)
        _require_int("batch_size", self.batch_size, 1)
        _require_int("accum_steps", self.accum_steps, 1)
        if self.batch_size % self.accum_steps:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of accum_steps ({self.accum_steps})")
        if isinstance(self.weight_decay, bool) or not isinstance(self.weight_decay, (int, float)) \
                or self.weight_decay < 0:
            raise ValueError(f"weight_decay must be a number >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        require_positive("eps", self.eps)
        if self.clip_norm is not None:
            require_positive("clip_norm", self.clip_norm)


@dataclass(frozen=True)
class StepLog:
    """One optimizer step: its index, the batch's mean loss (nats per token), the learning rate it
    used, the gradient norm before clipping, the tokens it scored and its wall-clock seconds."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


class Trainer:
    """Trains a causal LM (``model(ids)`` returns logits ``(B, T, V)`` or an object with ``.logits``,
    such as ``llmu.models.LlamaModel``) on a :class:`TokenWindows` stream, as the module
    docstring describes. ``step`` counts the optimizer steps taken; ``history`` holds their logs."""

    def __init__(self, model: nn.Module, data: TokenWindows, config: TrainConfig | None = None):
        config = TrainConfig() if config is None else config
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        if not isinstance(data, TokenWindows):
            raise TypeError(f"data must be a TokenWindows, got {type(data).__name__}")
        groups = adamw_param_groups(model, config.weight_decay)
        if not groups:
            raise ValueError("model has no parameter that requires grad: llmu's models are built for inference "
                             "(call model.train().requires_grad_(True), or use llmu.models.make_trainable)")
        max_len = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if max_len is not None and data.seq_len > max_len:
            raise ValueError(f"data.seq_len ({data.seq_len}) exceeds the model's max_position_embeddings ({max_len})")
        self.model, self.data, self.config = model, data, config
        self.parameters = [p for group in groups for p in group["params"]]
        self.optimizer = torch.optim.AdamW(groups, lr=config.peak_lr, betas=config.betas, eps=config.eps)
        self.scheduler = warmup_cosine_scheduler(self.optimizer, config.warmup, config.total_steps,
                                                 config.min_lr / config.peak_lr)
        self.step = 0
        self.history: list[StepLog] = []

    def loss(self, windows: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``windows`` ``(B, T + 1)``: read ids ``0..T-1``,
        predict ids ``1..T``. Computed in float32 whatever the model's dtype."""
        out = self.model(windows[:, :-1])
        logits = out.logits if hasattr(out, "logits") else out
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), windows[:, 1:].reshape(-1))

    def forward_backward(self, batch: torch.Tensor) -> float:
        """Accumulate into ``p.grad`` the gradient of the mean loss over ``batch`` ``(B, T + 1)``,
        in ``accum_steps`` micro-batches; return that mean loss."""
        k = self.config.accum_steps
        if batch.shape[0] % k:
            raise ValueError(f"batch of {batch.shape[0]} windows does not split into accum_steps={k} micro-batches")
        total = 0.0
        for micro in batch.chunk(k):
            loss = self.loss(micro) / k      # each micro-batch weighs 1/k: the sum is the mean over the batch
            loss.backward()                  # adds this micro-batch's gradient to p.grad
            total += loss.item()
        return total

    def train_step(self) -> StepLog:
        """One optimizer step on a fresh batch; returns (and records) its :class:`StepLog`."""
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        batch = self.data.sample(self.config.batch_size).to(_device_of(self.model))
        loss = self.forward_backward(batch)
        grad_norm, lr = optimizer_update(self.optimizer, self.scheduler, self.parameters, self.config.clip_norm)
        log = StepLog(self.step, loss, lr, grad_norm, batch.shape[0] * (batch.shape[1] - 1),
                      time.perf_counter() - start)
        self.step += 1
        self.history.append(log)
        return log

    def train(self, steps: int) -> list[StepLog]:
        """``steps`` optimizer steps; returns their logs."""
        return [self.train_step() for _ in range(_require_int("steps", steps, 0))]

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, path) -> None:
        """Write everything the next step depends on to ``path`` (module docstring). The file is
        written beside ``path`` first and then renamed over it, so a crash mid-write leaves the
        previous checkpoint intact."""
        state = {
            "step": self.step,
            "config": asdict(self.config),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": self.data.state_dict(),
            "rng": {"torch_cpu": torch.get_rng_state()},
            "history": [asdict(log) for log in self.history],
        }
        write_state(state, os.fspath(path))

    def load_checkpoint(self, path) -> None:
        """Restore a :meth:`save_checkpoint` file into this trainer, whose config must be the
        saved one (a different schedule or batch would not continue the same run)."""
        state = read_state(os.fspath(path))           # weights_only: a checkpoint is data, nothing in it runs
        mine = asdict(self.config)
        differ = sorted(k for k in mine if mine[k] != state["config"].get(k))
        if differ:
            raise ValueError("the checkpoint was saved with another TrainConfig: "
                             + ", ".join(f"{k}={state['config'].get(k)!r} (this trainer: {mine[k]!r})" for k in differ))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.data.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch_cpu"])
        self.step = state["step"]
        self.history = [StepLog(**log) for log in state["history"]]


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
