"""DPO: sequence log-probabilities over the response, the loss and its rewards, one training step."""

from __future__ import annotations

import math

import pytest
import torch

from llmu.models import load_tokenizer, tiny_llama
from llmu.training.dpo import (
    build_preference_batch,
    dpo_loss,
    dpo_step,
    frozen_reference,
    preference_pairs,
    sequence_logprobs,
    sequence_logprobs_from_logits,
)
from llmu.training.lora import add_lora, lora_disabled
from llmu.training.sft import IGNORE_INDEX, SFTExample, build_sft_example, collate_sft

M = IGNORE_INDEX
# two preference pairs over the tiny model's 97-token vocabulary: a shared prompt, then an answer
CHOSEN = [SFTExample([4, 20, 31, 7, 8, 9], [M, M, M, 7, 8, 9]), SFTExample([5, 6, 50, 51], [M, M, 50, 51])]
REJECTED = [SFTExample([4, 20, 31, 70, 71], [M, M, M, 70, 71]), SFTExample([5, 6, 88, 89, 90], [M, M, 88, 89, 90])]


def _batch():
    return collate_sft(CHOSEN + REJECTED, pad_token_id=0)


def _policy(seed=0):
    return tiny_llama(seed=seed).train().requires_grad_(True)


def test_sequence_logprobs_match_hand_computation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 13, generator=g)
    labels = torch.tensor([[M, M, 3, 12, M], [M, 0, 1, 2, 5]])
    expected = torch.zeros(2, dtype=torch.float64)
    for b in range(2):
        for t in range(1, 5):                  # label t is scored by the logits at t - 1
            if labels[b, t] != M:
                row = logits[b, t - 1].double()
                expected[b] += row[labels[b, t]] - torch.logsumexp(row, 0)
    # sums of 2 and 4 float32 log-softmax values of size ~3: agreement to ~1e-6
    torch.testing.assert_close(sequence_logprobs_from_logits(logits, labels).double(), expected,
                               rtol=1e-5, atol=1e-5)


def test_sequence_logprobs_ignore_prompt_and_padding():
    model = tiny_llama(seed=0)
    batch = _batch()
    with torch.no_grad():
        batched = sequence_logprobs(model, batch["input_ids"], batch["labels"])
        for row, ex in enumerate(CHOSEN + REJECTED):
            alone = sequence_logprobs(model, torch.tensor([ex.input_ids]), torch.tensor([ex.labels]))
            torch.testing.assert_close(batched[row], alone[0], rtol=1e-5, atol=1e-5)
    assert (batched < 0).all()


def test_loss_matches_hand_computation():
    pc, pr = torch.tensor([-3.0, -10.0, -4.5]), torch.tensor([-5.0, -9.0, -4.0])
    rc, rr = torch.tensor([-4.0, -9.5, -4.0]), torch.tensor([-4.5, -9.5, -4.2])
    beta = 0.5
    expected_terms = []
    for i in range(3):
        z = beta * ((pc[i] - rc[i]) - (pr[i] - rr[i])).item()
        expected_terms.append(-math.log(1 / (1 + math.exp(-z))))
    out = dpo_loss(pc, pr, rc, rr, beta=beta)
    assert out.loss.item() == pytest.approx(sum(expected_terms) / 3, rel=1e-6)
    torch.testing.assert_close(out.chosen_rewards, beta * (pc - rc))
    torch.testing.assert_close(out.rejected_rewards, beta * (pr - rr))
    # pair margins: 0.5*(1 - (-0.5)) = 0.75, 0.5*(-0.5 - 0.5) = -0.5, 0.5*(-0.5 - 0.2) = -0.35
    assert out.margin == pytest.approx((0.75 - 0.5 - 0.35) / 3, rel=1e-6)
    assert out.accuracy == pytest.approx(1 / 3)


def test_loss_is_stable_for_large_margins():
    far = torch.tensor([-1000.0])
    out = dpo_loss(torch.tensor([0.0]), far, torch.tensor([0.0]), torch.tensor([0.0]), beta=1.0)
    assert out.loss.item() == pytest.approx(0.0, abs=1e-30)
    out = dpo_loss(far, torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]), beta=1.0)
    assert out.loss.item() == pytest.approx(1000.0)      # -log sigmoid(-1000) = 1000 + log(1 + e^-1000)


def test_beta_scales_the_log_ratios():
    pc, pr = torch.tensor([-3.0, -6.0]), torch.tensor([-5.0, -5.5])
    rc, rr = torch.tensor([-4.0, -6.2]), torch.tensor([-4.0, -5.0])
    small, large = dpo_loss(pc, pr, rc, rr, beta=0.1), dpo_loss(pc, pr, rc, rr, beta=0.4)
    torch.testing.assert_close(large.chosen_rewards, 4 * small.chosen_rewards)
    assert large.margin == pytest.approx(4 * small.margin)
    # the loss depends on beta and the log-ratios only through their product
    d = (pc - rc) - (pr - rr)
    scaled = dpo_loss(0.4 * d, torch.zeros(2), torch.zeros(2), torch.zeros(2), beta=1.0)
    assert large.loss.item() == pytest.approx(scaled.loss.item(), rel=1e-6)
    # at policy = reference the gradient of the loss in each chosen log-prob is -beta / (2 B)
    for beta in (0.1, 0.4):
        pc0 = torch.zeros(2, requires_grad=True)
        dpo_loss(pc0, torch.zeros(2), torch.zeros(2), torch.zeros(2), beta=beta).loss.backward()
        torch.testing.assert_close(pc0.grad, torch.full((2,), -beta / 4))


def test_policy_equal_to_reference_gives_log_2():
    policy = _policy()
    reference = frozen_reference(policy)
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    out = dpo_step(policy, reference, _batch(), beta=0.1)
    # identical models give identical log-probs: z = 0 exactly and -log sigmoid(0) = log 2
    assert out.loss.item() == pytest.approx(math.log(2), rel=1e-6)
    assert out.margin == 0 and out.accuracy == 0
    assert torch.count_nonzero(out.chosen_rewards) == 0


def _margin(policy, batch):
    with torch.no_grad():
        logp = sequence_logprobs(policy, batch["input_ids"], batch["labels"])
    n = logp.shape[0] // 2
    return logp[:n] - logp[n:]


def test_one_step_raises_chosen_relative_to_rejected():
    policy = _policy()
    reference = frozen_reference(policy)
    batch = _batch()
    before = _margin(policy, batch)
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    out = dpo_step(policy, reference, batch, beta=0.5)
    opt.zero_grad()
    out.loss.backward()
    assert all(p.grad is None for p in reference.parameters())
    opt.step()
    after = _margin(policy, batch)
    assert (after > before).all(), (before, after)
    # and the loss, measured again, has dropped below log 2, with every pair ordered correctly
    again = dpo_step(policy, reference, batch, beta=0.5)
    assert again.loss.item() < math.log(2) and again.accuracy == 1.0 and again.margin > 0


def test_lora_policy_uses_its_base_as_reference():
    policy = add_lora(tiny_llama(seed=0), targets=("q_proj", "v_proj", "o_proj"), r=4, alpha=8).train()
    batch = _batch()
    with torch.no_grad():
        base_logp = sequence_logprobs(policy, batch["input_ids"], batch["labels"])
    assert dpo_step(policy, None, batch).loss.item() == pytest.approx(math.log(2), rel=1e-6)
    before = _margin(policy, batch)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        out = dpo_step(policy, None, batch, beta=0.5)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert (_margin(policy, batch) > before).all()
    with torch.no_grad(), lora_disabled(policy):        # the reference did not move
        torch.testing.assert_close(sequence_logprobs(policy, batch["input_ids"], batch["labels"]), base_logp,
                                   rtol=0, atol=0)


def test_preference_batch_and_shipped_pairs():
    tok = load_tokenizer()     # the tokenizer only, no model weights
    pairs = preference_pairs()
    assert len(pairs) == 30
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    batch = build_preference_batch(tok, pairs)
    assert batch["input_ids"].shape[0] == 60
    for i in (0, 29):
        for row, answer in ((i, pairs[i]["chosen"]), (30 + i, pairs[i]["rejected"])):
            labels = batch["labels"][row]
            assert tok.decode(labels[labels != M]) == answer + "<|im_end|>"
            ex = build_sft_example(tok, pairs[i]["prompt"], answer)
            assert batch["input_ids"][row, :len(ex)].tolist() == ex.input_ids


def test_bad_inputs():
    one = torch.zeros(2)
    with pytest.raises(ValueError, match="beta must be positive"):
        dpo_loss(one, one, one, one, beta=0.0)
    with pytest.raises(TypeError, match="beta must be a positive number"):
        dpo_loss(one, one, one, one, beta="0.1")
    with pytest.raises(ValueError, match="ref_rejected has shape"):
        dpo_loss(one, one, one, torch.zeros(3))
    with pytest.raises(ValueError, match="policy_chosen must be a non-empty 1-D"):
        dpo_loss(torch.zeros(2, 1), one, one, one)
    with pytest.raises(TypeError, match="ref_chosen must be a torch.Tensor"):
        dpo_loss(one, one, [0.0, 0.0], one)
    with pytest.raises(TypeError, match="floating point"):
        dpo_loss(one, one, one, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one response token"):
        sequence_logprobs_from_logits(torch.randn(2, 3, 5), torch.tensor([[M, 1, 2], [M, M, M]]))
    with pytest.raises(ValueError, match=r"labels must be \(batch, seq\)"):
        sequence_logprobs_from_logits(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    policy = _policy()
    with pytest.raises(ValueError, match="must be frozen"):
        dpo_step(policy, _policy(seed=1), _batch())
    with pytest.raises(ValueError, match="needs a LoRA policy"):
        dpo_step(policy, None, _batch())
    odd = collate_sft(CHOSEN + REJECTED[:1], pad_token_id=0)
    with pytest.raises(ValueError, match="even number"):
        dpo_step(policy, frozen_reference(policy), odd)
    with pytest.raises(ValueError, match="chosen and rejected are the same"):
        build_preference_batch(None, [{"prompt": "Hi?", "chosen": "Hello.", "rejected": "Hello."}])
    with pytest.raises(ValueError, match="non-empty list"):
        build_preference_batch(None, {"prompt": "Hi?", "chosen": "a", "rejected": "b"})
