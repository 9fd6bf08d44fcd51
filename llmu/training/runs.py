"""The three training runs of module 04, end to end: pretraining, SFT with LoRA, DPO.

Notebook 04 runs each for a few steps live; ``benchmarks/training_runs.py`` runs the same
functions for many more steps and ships what they log in ``llmu/data/training_runs.json``, so the
notebook can draw the long curves beside its short live ones. Every function here is seeded and
returns plain numbers (lists of dicts), which is what the JSON file holds.

- :func:`pretrain_small`: a small byte-level Llama (``llmu.models.byte_llama_config``, fresh
  weights from ``llmu.models.make_trainable``) learns to predict the next byte of the repository's
  essays with :class:`llmu.training.loop.Trainer`. The last ``heldout`` share of the text is never
  trained on: its loss, measured every ``eval_every`` steps, shows whether the model learns the
  language or memorises the windows it sees.
- :func:`sft_lora`: supervised fine-tuning of a model whose trainable parameters are LoRA adapters
  (:func:`llmu.training.lora.add_lora`) on instruction/answer pairs, the loss on the answer's tokens
  only (:mod:`llmu.training.sft`). The loss is computed from the final hidden states with
  :func:`llmu.training.cross_entropy.chunked_cross_entropy` (:func:`sft_batch_loss`): SmolLM2's
  vocabulary has 49,152 entries, and the ``(tokens, vocabulary)`` logits of a batch, their
  log-softmax and their gradient would be the largest tensors of the whole step.
- :func:`dpo_lora`: DPO (:mod:`llmu.training.dpo`) of a LoRA policy whose reference is the same
  model with its adapters switched off: one copy of the weights.

With ``schedule_steps`` larger than ``steps``, a run follows the learning-rate schedule of a longer
run and stops early: with the same seed, the live run of the notebook takes the very steps the
first ``steps`` of the recorded run took (the same numbers, up to the summation order of a
different thread count).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from llmu.checks import require_positive
from llmu.training.cross_entropy import chunked_cross_entropy
from llmu.training.loop import (
    TokenWindows,
    TrainConfig,
    Trainer,
    adamw_param_groups,
    optimizer_update,
    warmup_cosine_scheduler,
)
from llmu.training.sft import IGNORE_INDEX, build_sft_example, collate_sft

__all__ = ["ALL_PROJECTIONS", "batch_order", "dpo_lora", "final_hidden_states", "greedy_answers",
           "heldout_loss", "pretrain_small", "preference_eval", "sft_batch_loss", "sft_lora"]

#: the seven projections of a Llama block, the LoRA targets of the course's SFT and DPO runs
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _steps(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------
# Pretraining
# ----------------------------------------------------------------------------------------------

def heldout_loss(model: nn.Module, tokens: torch.Tensor, seq_len: int, windows: int = 16) -> float:
    """Mean next-token loss (nats per token) of ``model`` on up to ``windows`` consecutive,
    non-overlapping windows of ``seq_len + 1`` ids from the start of ``tokens`` (always the same
    windows, so successive measurements are comparable)."""
    require_positive("seq_len", seq_len, integer=True)
    require_positive("windows", windows, integer=True)
    n = min(windows, (tokens.numel() - 1) // seq_len)
    if n < 1:
        raise ValueError(f"tokens holds {tokens.numel()} ids: too few for one window of {seq_len + 1}")
    # windows overlap by one id: the last target of one is the first input of the next
    ids = torch.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]).long()
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
    model.train(was_training)
    return float(loss)


def pretrain_small(steps: int, *, hidden: int = 128, layers: int = 2, seq_len: int = 64, batch_size: int = 8,
                   peak_lr: float = 3e-3, warmup: int = 10, schedule_steps: int | None = None, text: str = "essays",
                   heldout: float = 0.1, eval_every: int = 10, seed: int = 0,
                   callback: Callable[[dict], object] | None = None) -> tuple[nn.Module, dict]:
    """Pretrain a fresh byte-level Llama (``hidden`` wide, ``layers`` deep) on ``llmu.data.text(text)``.

    The text's UTF-8 bytes are split: the first ``1 - heldout`` share is the training stream
    (random windows, :class:`~llmu.training.loop.TokenWindows` seeded with ``seed``), the rest the
    held-out text (:func:`heldout_loss`, before the first step and every ``eval_every`` steps and
    after the last). The schedule is warmup plus cosine over ``schedule_steps`` (default ``steps``).
    ``callback`` gets each step's log. Returns ``(model, record)``; ``record`` holds the settings,
    ``train`` (per step: loss, lr, grad_norm, seconds), ``heldout`` (step, loss) and ``seconds``.
    """
    from llmu.data import byte_tokens, text as shipped_text
    from llmu.models import byte_llama_config, make_trainable

    steps = _steps("steps", steps)
    schedule_steps = steps if schedule_steps is None else _steps("schedule_steps", schedule_steps)
    if schedule_steps < max(steps, 1):
        raise ValueError(f"schedule_steps ({schedule_steps}) must be at least steps ({steps}) and 1")
    if not 0 < heldout < 1:
        raise ValueError(f"heldout must be a fraction in (0, 1), got {heldout!r}")
    require_positive("eval_every", eval_every, integer=True)
    tokens = byte_tokens(shipped_text(text))
    cut = int(tokens.numel() * (1 - heldout))
    train_tokens, test_tokens = tokens[:cut], tokens[cut:]

    model = make_trainable(byte_llama_config(hidden=hidden, layers=layers, max_len=max(seq_len, 64)), seed=seed)
    config = TrainConfig(total_steps=schedule_steps, batch_size=batch_size, peak_lr=peak_lr, min_lr=peak_lr / 10,
                         warmup=min(warmup, schedule_steps))
    trainer = Trainer(model, TokenWindows(train_tokens, seq_len, seed=seed), config)
    record = {"settings": {"text": text, "hidden": hidden, "layers": layers, "seq_len": seq_len,
                           "batch_size": batch_size, "peak_lr": peak_lr, "warmup": config.warmup,
                           "schedule_steps": schedule_steps, "steps": steps, "heldout": heldout, "seed": seed,
                           "parameters": sum(p.numel() for p in model.parameters()),
                           "train_bytes": int(train_tokens.numel()), "heldout_bytes": int(test_tokens.numel())},
              "train": [], "heldout": [{"step": 0, "loss": heldout_loss(model, test_tokens, seq_len)}]}
    start = time.perf_counter()
    for _ in range(steps):
        log = trainer.train_step()
        row = {"step": log.step + 1, "loss": log.loss, "lr": log.lr, "grad_norm": log.grad_norm,
               "seconds": log.seconds}
        record["train"].append(row)
        if (log.step + 1) % eval_every == 0 or log.step + 1 == steps:
            record["heldout"].append({"step": log.step + 1, "loss": heldout_loss(model, test_tokens, seq_len)})
        if callback is not None:
            callback(row)
    record["seconds"] = time.perf_counter() - start
    return model, record


# ----------------------------------------------------------------------------------------------
# SFT with LoRA
# ----------------------------------------------------------------------------------------------

def final_hidden_states(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T, hidden)``: an ``llmu.models.LlamaModel``'s hidden states after its final norm, the
    input of its LM head, without computing the logits (the head is swapped for an identity for
    the duration of the call)."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(model, "norm"):
        raise TypeError(f"model must be an llmu LlamaModel (with norm and lm_head), got {type(model).__name__}")
    model.lm_head = nn.Identity()
    try:
        return model(input_ids).logits
    finally:
        model.lm_head = head


def sft_batch_loss(model: nn.Module, batch: dict, *, row_chunk: int = 128, vocab_chunk: int = 4096) -> torch.Tensor:
    """The SFT loss of a collated batch (``input_ids``, ``labels``), equal to
    ``sft_loss(model(input_ids).logits, labels)`` but computed from the final hidden states with
    :func:`~llmu.training.cross_entropy.chunked_cross_entropy`: at most ``row_chunk x vocab_chunk``
    logits exist at a time. Position ``t`` is scored against label ``t + 1``."""
    if not isinstance(batch, dict) or "input_ids" not in batch or "labels" not in batch:
        raise ValueError("batch must be a dict with input_ids and labels (from llmu.training.sft.collate_sft)")
    hidden = final_hidden_states(model, batch["input_ids"])
    target = batch["labels"][:, 1:].to(hidden.device)
    if not (target != IGNORE_INDEX).any():
        raise ValueError("labels hold no trained token (every next-token label is ignore_index)")
    return chunked_cross_entropy(hidden[:, :-1], model.lm_head.weight, target, ignore_index=IGNORE_INDEX,
                                 row_chunk=row_chunk, vocab_chunk=vocab_chunk)


def batch_order(n_items: int, batch_size: int, steps: int, seed: int = 0) -> list[list[int]]:
    """Index lists of ``steps`` batches: epochs over ``range(n_items)``, each a fresh seeded
    permutation cut into batches of ``batch_size`` (a batch never spans two epochs; the last,
    smaller batch of an epoch is kept)."""
    require_positive("n_items", n_items, integer=True)
    require_positive("batch_size", batch_size, integer=True)
    steps = _steps("steps", steps)
    g = torch.Generator().manual_seed(seed)
    out: list[list[int]] = []
    while len(out) < steps:
        perm = torch.randperm(n_items, generator=g).tolist()
        out.extend(perm[i:i + batch_size] for i in range(0, n_items, batch_size))
    return out[:steps]


def _trainable(model: nn.Module, lr: float, warmup: int, schedule_steps: int):
    groups = adamw_param_groups(model, 0.0)
    if not groups:
        raise ValueError("model has no trainable parameter: add LoRA adapters first (llmu.training.lora.add_lora)")
    params = [p for group in groups for p in group["params"]]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999))
    scheduler = warmup_cosine_scheduler(optimizer, min(warmup, schedule_steps), schedule_steps, 0.1)
    return params, optimizer, scheduler


def _check_schedule(steps, schedule_steps):
    steps = _steps("steps", steps)
    schedule_steps = steps if schedule_steps is None else _steps("schedule_steps", schedule_steps)
    if schedule_steps < max(steps, 1):
        raise ValueError(f"schedule_steps ({schedule_steps}) must be at least steps ({steps}) and 1")
    return steps, schedule_steps


def sft_lora(model: nn.Module, tokenizer, examples: Sequence[dict], steps: int, *, batch_size: int = 6,
             micro_batch: int | None = 2, lr: float = 1e-3, warmup: int = 4, schedule_steps: int | None = None,
             clip_norm: float = 1.0, seed: int = 0, callback: Callable[[dict], object] | None = None) -> list[dict]:
    """``steps`` AdamW steps of SFT on ``examples`` (``{"instruction", "answer"}`` dicts) of the
    trainable parameters of ``model`` (the LoRA adapters).

    Batches of ``batch_size`` examples follow :func:`batch_order`. Each batch runs as micro-batches
    of ``micro_batch`` examples (``None``: all at once) whose gradients add up: a micro-batch's
    loss, a mean over its answer tokens, is weighted by its share of the batch's answer tokens, so
    the sum is the gradient of the mean over the whole batch, with the activation memory of one
    micro-batch (what the backward pass keeps of 30 layers is most of SmolLM2's training memory).
    The learning rate warms up over ``warmup`` steps, then follows a cosine to ``lr / 10`` at
    ``schedule_steps`` (default ``steps``); gradients are clipped to norm ``clip_norm``.
    Returns one log per step: ``step``, ``loss`` (mean over the batch's answer tokens), ``lr``,
    ``grad_norm`` (before clipping), ``tokens`` (answer tokens scored) and ``seconds``."""
    steps, schedule_steps = _check_schedule(steps, schedule_steps)
    if not isinstance(examples, Sequence) or not examples:
        raise ValueError("examples must be a non-empty list of {'instruction', 'answer'} dicts")
    require_positive("lr", lr)
    micro = batch_size if micro_batch is None else require_positive("micro_batch", micro_batch, integer=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = [build_sft_example(tokenizer, ex["instruction"], ex["answer"]) for ex in examples]
    params, optimizer, scheduler = _trainable(model, lr, warmup, schedule_steps)
    logs = []
    model.train()
    for step, indices in enumerate(batch_order(len(encoded), batch_size, steps, seed), start=1):
        start = time.perf_counter()
        total_tokens = sum(encoded[i].num_trained for i in indices)
        optimizer.zero_grad(set_to_none=True)
        batch_loss = 0.0
        for m0 in range(0, len(indices), micro):
            part = [encoded[i] for i in indices[m0:m0 + micro]]
            weight = sum(ex.num_trained for ex in part) / total_tokens     # this micro-batch's share of the tokens
            loss = sft_batch_loss(model, collate_sft(part, pad)) * weight
            loss.backward()                                                 # adds to the adapters' .grad
            batch_loss += loss.detach().item()
        grad_norm, step_lr = optimizer_update(optimizer, scheduler, params, clip_norm)
        row = {"step": step, "loss": batch_loss, "lr": step_lr, "grad_norm": grad_norm, "tokens": total_tokens,
               "seconds": time.perf_counter() - start}
        logs.append(row)
        if callback is not None:
            callback(row)
    model.eval()
    return logs


def greedy_answers(model: nn.Module, tokenizer, instructions: Sequence[str], max_new_tokens: int = 48) -> list[str]:
    """The model's greedy answer to each instruction, asked as a one-turn chat."""
    from llmu.models import generate

    if isinstance(instructions, str) or not instructions:
        raise ValueError("instructions must be a non-empty list of str")
    was_training = model.training
    model.eval()
    answers = [str(generate(model, tokenizer, [{"role": "user", "content": text}], max_new_tokens))
               for text in instructions]
    model.train(was_training)
    return answers


# ----------------------------------------------------------------------------------------------
# DPO with LoRA
# ----------------------------------------------------------------------------------------------

def preference_eval(model: nn.Module, tokenizer, pairs: Sequence[dict], *, beta: float = 0.1) -> dict:
    """The DPO loss, mean reward margin and reward accuracy of a LoRA policy on ``pairs``, without
    gradients (the reference: the same model with its adapters off)."""
    from llmu.training.dpo import build_preference_batch, dpo_step

    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = dpo_step(model, None, build_preference_batch(tokenizer, list(pairs)), beta=beta)
    model.train(was_training)
    return {"loss": float(out.loss), "margin": out.margin, "accuracy": out.accuracy}


def dpo_lora(model: nn.Module, tokenizer, pairs: Sequence[dict], steps: int, *, batch_pairs: int = 4,
             micro_pairs: int | None = 2, beta: float = 0.1, lr: float = 1e-3, warmup: int = 2,
             schedule_steps: int | None = None, clip_norm: float = 1.0, seed: int = 0,
             callback: Callable[[dict], object] | None = None) -> list[dict]:
    """``steps`` AdamW steps of DPO on ``pairs`` (``{"prompt", "chosen", "rejected"}`` dicts) for a
    LoRA policy (``model`` with adapters; the reference is the model with them off, through
    :func:`llmu.training.dpo.dpo_step` with ``reference=None``).

    Batches of ``batch_pairs`` pairs follow :func:`batch_order`, each run as micro-batches of
    ``micro_pairs`` pairs (``None``: all at once) whose losses, means over their pairs, are weighted
    by their share of the pairs (as in :func:`sft_lora`). The schedule is as in :func:`sft_lora`.
    Returns one log per step: ``step``, ``loss``, ``margin`` (mean chosen minus rejected implicit
    reward), ``accuracy`` (share of pairs with the larger reward on the chosen answer), the mean
    ``chosen_reward`` and ``rejected_reward``, ``lr``, ``grad_norm`` and ``seconds``. The rewards
    are those of the batch *before* the step's update."""
    from llmu.training.dpo import build_preference_batch, dpo_step

    steps, schedule_steps = _check_schedule(steps, schedule_steps)
    if not isinstance(pairs, Sequence) or not pairs:
        raise ValueError("pairs must be a non-empty list of {'prompt', 'chosen', 'rejected'} dicts")
    require_positive("beta", beta)
    require_positive("lr", lr)
    micro = batch_pairs if micro_pairs is None else require_positive("micro_pairs", micro_pairs, integer=True)
    params, optimizer, scheduler = _trainable(model, lr, warmup, schedule_steps)
    logs = []
    model.train()
    for step, indices in enumerate(batch_order(len(pairs), batch_pairs, steps, seed), start=1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        batch_loss, chosen, rejected = 0.0, [], []
        for m0 in range(0, len(indices), micro):
            part = [pairs[i] for i in indices[m0:m0 + micro]]
            out = dpo_step(model, None, build_preference_batch(tokenizer, part), beta=beta)
            loss = out.loss * (len(part) / len(indices))     # this micro-batch's share of the pairs
            loss.backward()
            batch_loss += loss.detach().item()
            chosen.append(out.chosen_rewards)
            rejected.append(out.rejected_rewards)
        chosen, rejected = torch.cat(chosen), torch.cat(rejected)
        grad_norm, step_lr = optimizer_update(optimizer, scheduler, params, clip_norm)
        if not math.isfinite(batch_loss):
            raise FloatingPointError(f"DPO loss became {batch_loss} at step {step}: lower lr")
        row = {"step": step, "loss": batch_loss, "margin": float((chosen - rejected).mean()),
               "accuracy": float((chosen > rejected).float().mean()), "chosen_reward": float(chosen.mean()),
               "rejected_reward": float(rejected.mean()), "lr": step_lr, "grad_norm": grad_norm,
               "seconds": time.perf_counter() - start}
        logs.append(row)
        if callback is not None:
            callback(row)
    model.eval()
    return logs
