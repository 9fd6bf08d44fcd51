"""GRPO: group-relative advantages, the clipped surrogate with a k3 KL penalty, masks and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from llmu.training.grpo import group_advantages, grpo_loss, k3_kl


def _batch(p=2, g=3, t=5, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    new = -torch.rand(p, g, t, generator=gen, dtype=dtype) * 3
    old = new + torch.randn(p, g, t, generator=gen, dtype=dtype) * 0.1
    ref = new + torch.randn(p, g, t, generator=gen, dtype=dtype) * 0.3
    rewards = torch.randn(p, g, generator=gen, dtype=dtype)
    lengths = torch.randint(1, t + 1, (p, g), generator=gen)
    mask = torch.arange(t) < lengths.unsqueeze(-1)
    return new, old, ref, rewards, mask


def _loop_loss(new, old, ref, rewards, mask, clip_eps=0.2, beta=0.04, eps=1e-4):
    """The loss written out with Python loops, in float64."""
    p_, g_, t_ = new.shape
    total = 0.0
    for p in range(p_):
        r = [float(x) for x in rewards[p]]
        mean = sum(r) / g_
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (g_ - 1))
        for g in range(g_):
            a = (r[g] - mean) / (std + eps)
            terms = []
            for t in range(t_):
                if mask[p, g, t]:
                    ratio = math.exp(float(new[p, g, t] - old[p, g, t]))
                    surr = min(ratio * a, min(max(ratio, 1 - clip_eps), 1 + clip_eps) * a)
                    d = float(ref[p, g, t] - new[p, g, t])
                    terms.append(-(surr - beta * (math.exp(d) - d - 1)))
            total += sum(terms) / len(terms)
    return total / (p_ * g_)


def test_advantages_are_normalised_per_group_with_the_sample_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 5.0, 7.0, 9.0]], dtype=torch.float64)
    adv = group_advantages(rewards, eps=0.0 + 1e-12)
    # group 0: mean 0.5, sample std sqrt(1/3); group 1: mean 6, sample std sqrt(20/3)
    torch.testing.assert_close(adv[0], torch.tensor([1, -1, -1, 1], dtype=torch.float64) * 0.5 / math.sqrt(1 / 3))
    torch.testing.assert_close(adv[1], torch.tensor([-3, -1, 1, 3], dtype=torch.float64) / math.sqrt(20 / 3))


def test_identical_rewards_give_zero_advantage_not_nan():
    adv = group_advantages(torch.tensor([[2.0, 2.0, 2.0], [0.0, 1.0, 2.0]]))
    assert torch.equal(adv[0], torch.zeros(3))
    new, old, ref, _, mask = _batch(p=2, g=3)
    out = grpo_loss(new, old, ref, torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]], dtype=torch.float64), mask)
    assert math.isfinite(out.loss.item()) and out.advantage_mean == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_matches_a_loop_written_out(seed):
    new, old, ref, rewards, mask = _batch(p=3, g=4, t=6, seed=seed)
    old = new + torch.randn(new.shape, generator=torch.Generator().manual_seed(seed + 10), dtype=new.dtype) * 0.3
    out = grpo_loss(new, old, ref, rewards, mask, clip_eps=0.1, beta=0.2)
    assert out.loss.item() == pytest.approx(_loop_loss(new, old, ref, rewards, mask, 0.1, 0.2), rel=1e-12, abs=1e-12)


def test_ratio_one_gives_the_policy_gradient():
    """new = old = ref: ratio 1, k3 0, and the gradient is -A / (|o| P G) on each valid token."""
    new, _, _, rewards, mask = _batch(p=2, g=4, t=5)
    x = new.clone().requires_grad_(True)
    out = grpo_loss(x, new, new, rewards, mask)
    out.loss.backward()
    adv = group_advantages(rewards).unsqueeze(-1)
    want = -adv * mask / mask.sum(-1, keepdim=True) / (2 * 4)
    torch.testing.assert_close(x.grad, want)
    assert out.kl == 0.0 and out.clip_fraction == 0.0


def test_clip_stops_the_gradient_past_the_clip_in_the_advantages_direction():
    # one prompt, two completions of one token: rewards 1 and 0 give advantages +a and -a
    rewards = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, 1, dtype=torch.bool)
    old = torch.zeros(1, 2, 1, dtype=torch.float64)
    cases = {  # ratios of the two completions -> is each one's gradient stopped?
        (1.3, 0.7): (True, True),       # A > 0 above 1 + eps, A < 0 below 1 - eps: clipped
        (0.7, 1.3): (False, False),     # the other sides: the unclipped term is the minimum
        (1.19, 0.81): (False, False),   # inside the clip range
    }
    for ratios, stopped in cases.items():
        new = torch.log(torch.tensor(ratios, dtype=torch.float64)).view(1, 2, 1).requires_grad_(True)
        out = grpo_loss(new, old, new.detach(), rewards, mask, beta=0.0)
        out.loss.backward()
        for i in range(2):
            assert (new.grad[0, i, 0] == 0) == stopped[i], (ratios, i, new.grad)
        assert out.clip_fraction == sum(stopped) / 2


def test_masked_tokens_contribute_nothing():
    new, old, ref, rewards, mask = _batch(p=2, g=3, t=6, seed=4)
    junk_new, junk_old, junk_ref = new.clone(), old.clone(), ref.clone()
    junk_new[~mask], junk_old[~mask], junk_ref[~mask] = 1e4, -1e4, 30.0     # exponentials overflow
    a = new.clone().requires_grad_(True)
    b = junk_new.clone().requires_grad_(True)
    out_a = grpo_loss(a, old, ref, rewards, mask)
    out_b = grpo_loss(b, junk_old, junk_ref, rewards, mask)
    out_a.loss.backward()
    out_b.loss.backward()
    assert out_a.loss.item() == out_b.loss.item() and out_a.stats() == out_b.stats()
    torch.testing.assert_close(a.grad, b.grad)
    assert torch.all(b.grad[~mask] == 0)
    # a float mask of 0/1 acts as the bool one
    assert grpo_loss(new, old, ref, rewards, mask.double()).loss.item() == out_a.loss.item()


def test_k3_is_zero_at_the_reference_and_never_negative():
    x = torch.linspace(-20, 5, 101, dtype=torch.float64)
    assert torch.equal(k3_kl(x, x), torch.zeros_like(x))
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=gen) * 5, torch.randn(1000, generator=gen) * 5
    assert (k3_kl(a, b) >= 0).all()


def test_no_gradient_reaches_old_ref_or_rewards():
    new, old, ref, rewards, mask = _batch()
    tensors = [t.clone().requires_grad_(True) for t in (new, old, ref, rewards)]
    grpo_loss(*tensors, mask).loss.backward()
    assert tensors[0].grad is not None
    assert all(t.grad is None for t in tensors[1:])


def test_bad_input_raises():
    new, old, ref, rewards, mask = _batch(p=2, g=3, t=4)
    with pytest.raises(ValueError, match="logp_old"):
        grpo_loss(new, old[:, :, :3], ref, rewards, mask)
    with pytest.raises(ValueError, match="rewards"):
        grpo_loss(new, old, ref, rewards[:, :2], mask)
    with pytest.raises(ValueError, match="G >= 2"):
        grpo_loss(new[:, :1], old[:, :1], ref[:, :1], rewards[:, :1], mask[:, :1])
    with pytest.raises(ValueError, match="clip_eps"):
        grpo_loss(new, old, ref, rewards, mask, clip_eps=0.0)
    with pytest.raises(ValueError, match="beta"):
        grpo_loss(new, old, ref, rewards, mask, beta=-0.01)
    empty = mask.clone()
    empty[1, 2] = False
    with pytest.raises(ValueError, match="valid token"):
        grpo_loss(new, old, ref, rewards, empty)
    with pytest.raises(ValueError, match="logp_new"):
        grpo_loss(new[0], old[0], ref[0], rewards, mask[0])
    with pytest.raises(TypeError, match="rewards"):
        grpo_loss(new, old, ref, [[1.0, 2.0, 3.0]] * 2, mask)
    grpo_loss(new, old, ref, rewards, mask, beta=0.0)            # beta = 0 is allowed: no KL penalty
