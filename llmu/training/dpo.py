"""DPO: align a model with preferences, straight from pairs of answers (Rafailov et al., 2023).

The data are triples (prompt, chosen answer, rejected answer). RLHF would fit a reward model to
them and then run reinforcement learning against it; DPO shows that the optimal policy of that
problem (maximise reward, stay close to a reference model ``ref`` by a KL penalty of weight
``beta``) defines an *implicit reward*::

    r(x, y) = beta * (log pi(y | x) - log ref(y | x))

and that the Bradley-Terry likelihood of the preferences under that reward is a plain loss on
the policy::

    loss = -log sigmoid( beta * [ (log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x)) ] )

``log pi(y | x)`` is the log-probability of the whole answer: the sum, over the answer's tokens
only, of each token's log-probability given the prompt and the answer so far. The reference model
is frozen (usually the SFT model the policy starts from; with LoRA, the same model with its
adapters off — :func:`llmu.training.lora.lora_disabled`). At the start policy = reference, every
log-ratio is 0 and the loss is ``-log sigmoid(0) = log 2``.

The gradient raises the chosen answer's log-probability and lowers the rejected one's, weighted
by ``sigmoid(-margin)``: pairs the model already orders well barely count. ``beta`` sets how far
the policy may drift from the reference: small ``beta`` needs a large log-ratio margin to
saturate the loss.

Reported alongside the loss: the rewards of the chosen and rejected answers, their mean margin,
and the accuracy (share of pairs whose chosen reward is higher).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmu.checks import require_positive
from llmu.training.sft import IGNORE_INDEX, build_sft_example, check_logits_labels, collate_sft

__all__ = ["DPOOutput", "build_preference_batch", "dpo_loss", "dpo_step", "frozen_reference",
           "preference_pairs", "sequence_logprobs", "sequence_logprobs_from_logits"]


def sequence_logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, *,
                                  ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``(B,)``: for each row, the sum of ``log p(token t | tokens < t)`` over the labelled tokens.

    ``logits``: ``(B, T, V)``; ``labels``: ``(B, T)`` aligned with the inputs, the token id on the
    response and ``ignore_index`` on the prompt and the padding (what
    :func:`llmu.training.sft.build_sft_example` makes). Logits at ``t`` score label ``t + 1``.
    """
    check_logits_labels(logits, labels)
    target = labels[:, 1:].long()
    mask = target != ignore_index
    if not mask.any(dim=1).all():
        raise ValueError("every row of labels needs at least one response token (not ignore_index)")
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)            # (B, T-1, V) in float32
    token_logp = logp.gather(-1, target.masked_fill(~mask, 0).unsqueeze(-1)).squeeze(-1)
    return (token_logp * mask).sum(dim=1)


def sequence_logprobs(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(B,)`` log-probability of each row's response under ``model`` (see
    :func:`sequence_logprobs_from_logits`); gradients flow when the model has trainable parameters."""
    out = model(input_ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return sequence_logprobs_from_logits(logits, labels.to(logits.device))


@dataclass
class DPOOutput:
    """``loss`` (scalar, the batch mean); per pair ``chosen_rewards`` and ``rejected_rewards``
    (``beta * log-ratio``, detached); ``margin`` (mean chosen - rejected reward) and ``accuracy``
    (share of pairs with chosen reward > rejected reward) as floats."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    margin: float
    accuracy: float


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, *, beta: float = 0.1) -> DPOOutput:
    """The DPO loss from sequence log-probabilities, each a ``(B,)`` tensor (one value per pair).

    ``-log sigmoid(z)`` is computed as ``-logsigmoid(z)`` (``softplus(-z)``), which stays finite
    for any ``z``; ``log(sigmoid(z))`` underflows to ``log 0`` when ``z`` is very negative.
    """
    require_positive("beta", beta)
    named = {"policy_chosen": policy_chosen, "policy_rejected": policy_rejected,
             "ref_chosen": ref_chosen, "ref_rejected": ref_rejected}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 1 or t.shape[0] == 0:
            raise ValueError(f"{name} must be a non-empty 1-D tensor (one log-probability per pair), "
                             f"got shape {tuple(t.shape)}")
        if t.shape != policy_chosen.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but policy_chosen has {tuple(policy_chosen.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    # the reference is frozen: no gradient reaches it even if a caller forgot no_grad
    ref_chosen, ref_rejected = ref_chosen.detach(), ref_rejected.detach()
    chosen_logratio = policy_chosen - ref_chosen
    rejected_logratio = policy_rejected - ref_rejected
    logits = beta * (chosen_logratio - rejected_logratio)
    loss = -F.logsigmoid(logits).mean()
    chosen_rewards = (beta * chosen_logratio).detach()
    rejected_rewards = (beta * rejected_logratio).detach()
    return DPOOutput(
        loss=loss,
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        margin=(chosen_rewards - rejected_rewards).mean().item(),
        accuracy=(chosen_rewards > rejected_rewards).float().mean().item(),
    )


def frozen_reference(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in eval mode with every parameter frozen: the DPO reference."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return copy.deepcopy(model).eval().requires_grad_(False)


def build_preference_batch(tokenizer, triples: Sequence[dict], *, max_length: int | None = None
                           ) -> dict[str, torch.Tensor]:
    """Tokens of ``[{"prompt", "chosen", "rejected"}, ...]`` for :func:`dpo_step`.

    Each answer becomes an SFT example (chat template, labels on the answer and its end-of-turn
    token); the chosen answers fill rows ``0 .. N-1`` and the rejected ones rows ``N .. 2N-1`` of one
    right-padded batch, so that one forward pass scores both.
    """
    if not isinstance(triples, Sequence) or isinstance(triples, (str, dict)) or not triples:
        raise ValueError("triples must be a non-empty list of {'prompt', 'chosen', 'rejected'} dicts")
    chosen, rejected = [], []
    for i, triple in enumerate(triples):
        if not isinstance(triple, dict) or not {"prompt", "chosen", "rejected"} <= set(triple):
            raise ValueError(f"triples[{i}] must be a dict with prompt, chosen and rejected, got {triple!r}")
        if triple["chosen"] == triple["rejected"]:
            raise ValueError(f"triples[{i}]: chosen and rejected are the same answer")
        chosen.append(build_sft_example(tokenizer, triple["prompt"], triple["chosen"], max_length=max_length))
        rejected.append(build_sft_example(tokenizer, triple["prompt"], triple["rejected"], max_length=max_length))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return collate_sft(chosen + rejected, pad)


def dpo_step(policy: nn.Module, reference: nn.Module | None, batch: dict[str, torch.Tensor], *,
             beta: float = 0.1) -> DPOOutput:
    """The DPO loss of a batch from :func:`build_preference_batch` (call ``.backward()`` on ``.loss``).

    ``reference``: the frozen reference model, or ``None`` for a LoRA policy, whose reference is
    then the policy itself with its adapters off (after a LoRA SFT, call
    :func:`llmu.training.lora.unload_lora` before adding the DPO adapters, so that this reference is
    the SFT model). The reference runs without gradients.
    """
    from llmu.training.lora import lora_disabled, lora_layers

    if not isinstance(batch, dict) or "input_ids" not in batch or "labels" not in batch:
        raise ValueError("batch must be a dict with input_ids and labels (from build_preference_batch)")
    input_ids, labels = batch["input_ids"], batch["labels"]
    if input_ids.ndim != 2 or input_ids.shape[0] % 2:
        raise ValueError(f"batch rows must be the chosen then the rejected answers (an even number), "
                         f"got shape {tuple(input_ids.shape)}")
    if reference is None and not lora_layers(policy):
        raise ValueError("reference=None needs a LoRA policy (its base model is the reference); pass a "
                         "frozen_reference(model) otherwise")
    if reference is not None and any(p.requires_grad for p in reference.parameters()):
        raise ValueError("the reference model must be frozen (use frozen_reference(model))")
    n = input_ids.shape[0] // 2
    policy_logp = sequence_logprobs(policy, input_ids, labels)
    with torch.no_grad(), (lora_disabled(policy) if reference is None else nullcontext()):
        ref_logp = sequence_logprobs(policy if reference is None else reference, input_ids, labels)
    return dpo_loss(policy_logp[:n], policy_logp[n:], ref_logp[:n], ref_logp[n:], beta=beta)


def preference_pairs() -> list[dict[str, str]]:
    """The preference set shipped with llmu (``llmu/data/preference_pairs.json``): a list of
    ``{"prompt", "chosen", "rejected"}`` written for this repository."""
    from llmu.data import json as data_json

    rows = data_json("preference_pairs")["pairs"]
    for i, row in enumerate(rows):
        if set(row) != {"prompt", "chosen", "rejected"}:
            raise ValueError(f"preference_pairs.json row {i} must have keys prompt, chosen, rejected, "
                             f"got {sorted(row)}")
    return rows
