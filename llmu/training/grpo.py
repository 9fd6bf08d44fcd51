"""GRPO: policy optimisation with group-relative advantages (Shao et al., 2024, DeepSeekMath).

PPO trains a value network beside the policy to estimate each token's baseline. GRPO drops it: for
each prompt it samples a *group* of ``G`` completions, scores each with a scalar reward, and uses
the group itself as the baseline. Completion ``i``'s advantage, shared by all of its tokens, is its
reward normalised within its group::

    A_i = (r_i - mean(r)) / (std(r) + eps)

with ``std`` the sample standard deviation (Bessel's correction, torch's default ``Tensor.std``).
A group whose rewards are all equal teaches nothing: every advantage is 0 (``eps`` keeps the
division finite).

The loss of one token keeps PPO's clipped surrogate and adds a KL penalty to a frozen reference
policy, estimated per token by Schulman's "k3" estimator, which is unbiased and never negative::

    ratio = exp(logp_new - logp_old)
    surrogate = min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)
    k3 = exp(logp_ref - logp_new) - (logp_ref - logp_new) - 1
    token loss = -(surrogate - beta * k3)

averaged over each completion's valid tokens (``mask``), then over the ``P * G`` completions of
the batch, as in DeepSeekMath. That normalisation is a choice, and later work changed it: DAPO
(Yu et al., 2025) averages over all tokens of the batch at once, and Dr. GRPO (Liu et al., 2025)
drops both the per-completion length normalisation and the division by the group's std, which
bias the objective (towards longer wrong answers, and towards groups whose rewards barely vary).

``logp_old`` (the policy that sampled the completions) and ``logp_ref`` are constants: no
gradient reaches them, nor the rewards. Padded positions may hold any value; they are replaced
before any exponential, so they change neither the loss nor its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GRPOOutput", "grpo_loss", "group_advantages", "k3_kl"]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``(P, G)`` rewards -> ``(P, G)`` advantages, normalised within each row (one prompt's group)
    by its mean and its sample std (Bessel's correction) plus ``eps``."""
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.ndim != 2 or rewards.shape[0] == 0:
        raise ValueError(f"rewards must be (P, G) with P >= 1, got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"a group needs G >= 2 completions to have a baseline, got G = {rewards.shape[1]}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    rewards = rewards.detach()
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)              # unbiased: divides by G - 1
    return (rewards - mean) / (std + eps)


def k3_kl(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(new || ref) from log-probabilities of tokens sampled from ``new``:
    ``exp(ref - new) - (ref - new) - 1``, zero where they agree and never negative (``e^x >= 1 + x``)."""
    d = logp_ref - logp_new
    return torch.exp(d) - d - 1


@dataclass
class GRPOOutput:
    """``loss`` (scalar); ``kl``: the mean k3, normalised as the loss is; ``clip_fraction``: the share
    of the batch's valid tokens whose gradient the clip stops; ``advantage_mean``: the mean advantage
    over the completions (about 0 by construction)."""

    loss: torch.Tensor
    kl: float
    clip_fraction: float
    advantage_mean: float

    def stats(self) -> dict[str, float]:
        return {"kl": self.kl, "clip_fraction": self.clip_fraction, "advantage_mean": self.advantage_mean}


def grpo_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, logp_ref: torch.Tensor, rewards: torch.Tensor,
              mask: torch.Tensor, *, clip_eps: float = 0.2, beta: float = 0.04, eps: float = 1e-4) -> GRPOOutput:
    """The GRPO loss of ``P`` prompts x ``G`` completions x ``T`` tokens.

    ``logp_new``, ``logp_old``, ``logp_ref``: ``(P, G, T)`` log-probabilities of the sampled tokens
    under the policy being trained, the policy that sampled them and the reference; ``rewards``:
    ``(P, G)``; ``mask``: ``(P, G, T)``, true (or 1) on a completion's tokens, false on padding. Every
    completion needs at least one valid token.
    """
    tensors = {"logp_new": logp_new, "logp_old": logp_old, "logp_ref": logp_ref, "mask": mask}
    for name, t in {**tensors, "rewards": rewards}.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logp_new.ndim != 3:
        raise ValueError(f"logp_new must be (P, G, T), got shape {tuple(logp_new.shape)}")
    for name, t in tensors.items():
        if t.shape != logp_new.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but logp_new has {tuple(logp_new.shape)}")
    if rewards.shape != logp_new.shape[:2]:
        raise ValueError(f"rewards must be (P, G) = {tuple(logp_new.shape[:2])}, got {tuple(rewards.shape)}")
    if not clip_eps > 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    valid = mask.bool()
    n_tokens = valid.sum(dim=2)                                          # (P, G)
    if (n_tokens == 0).any():
        raise ValueError("every completion needs at least one valid token in mask")
    adv = group_advantages(rewards, eps).to(logp_new.dtype).unsqueeze(-1)    # (P, G, 1), a constant
    # padding may hold anything: zero the differences there before any exponential
    zero = torch.zeros((), dtype=logp_new.dtype, device=logp_new.device)
    log_ratio = torch.where(valid, logp_new - logp_old.detach(), zero)
    log_ref_ratio = torch.where(valid, logp_ref.detach() - logp_new, zero)
    ratio = torch.exp(log_ratio)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1                        # k3, 0 on padding
    per_token = torch.where(valid, -(surrogate - beta * kl), zero)
    loss = (per_token.sum(dim=2) / n_tokens).mean()
    with torch.no_grad():
        clipped = valid & (((ratio > 1 + clip_eps) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0)))
        kl_mean = ((kl * valid).sum(dim=2) / n_tokens).mean()
    return GRPOOutput(loss=loss, kl=float(kl_mean), clip_fraction=float(clipped.sum() / valid.sum()),
                      advantage_mean=float(adv.mean()))
