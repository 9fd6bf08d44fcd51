"""The training runs of module 04 (llmu.training.runs) at tiny settings: what they record, that a
short run is the prefix of a long one, that micro-batches give the batch's step, and that the
chunked SFT loss equals the plain one."""

from __future__ import annotations

import math

import pytest
import torch

from llmu.data import byte_tokens, text
from llmu.models import load_tokenizer, tiny_llama
from llmu.training.dpo import preference_pairs
from llmu.training.lora import add_lora, lora_state_dict
from llmu.training.runs import (
    ALL_PROJECTIONS,
    batch_order,
    dpo_lora,
    final_hidden_states,
    greedy_answers,
    heldout_loss,
    preference_eval,
    pretrain_small,
    sft_batch_loss,
    sft_lora,
)
from llmu.training.sft import build_sft_example, collate_sft, sft_examples, sft_loss


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()     # SmolLM2's tokenizer and chat template (no model weights)


def _tiny_chat_model(tok, seed=0):
    # the tiny decoder with SmolLM2's vocabulary, so the real tokenizer's ids fit
    return tiny_llama(seed=seed, vocab_size=49152, eos_token_id=tok.eos_token_id)


def _adapters(model):
    return {k: v.clone() for k, v in lora_state_dict(model).items()}


def test_pretrain_records_and_learns():
    model, record = pretrain_small(8, hidden=64, layers=1, seq_len=32, batch_size=4, warmup=2, eval_every=4)
    assert [r["step"] for r in record["train"]] == list(range(1, 9))
    assert [r["step"] for r in record["heldout"]] == [0, 4, 8]
    # a fresh byte model guesses near-uniformly: ln 256 = 5.55; 8 steps already lower both losses
    assert abs(record["heldout"][0]["loss"] - math.log(256)) < 0.1
    assert record["heldout"][-1]["loss"] < record["heldout"][0]["loss"] - 0.5
    assert record["train"][-1]["loss"] < record["train"][0]["loss"]
    s = record["settings"]
    assert s["train_bytes"] + s["heldout_bytes"] == len(text("essays").encode())
    assert s["parameters"] == sum(p.numel() for p in model.parameters())


def test_short_pretraining_is_the_prefix_of_a_long_one():
    _, long = pretrain_small(6, hidden=64, layers=1, seq_len=32, batch_size=4, warmup=2, eval_every=3)
    _, short = pretrain_small(3, schedule_steps=6, hidden=64, layers=1, seq_len=32, batch_size=4, warmup=2,
                              eval_every=3)
    # same seed, same schedule, same thread count: the very same steps
    assert short["train"] == [{**row, "seconds": s["seconds"]} for row, s in zip(long["train"][:3], short["train"])]
    with pytest.raises(ValueError, match="schedule_steps"):
        pretrain_small(5, schedule_steps=4)
    with pytest.raises(ValueError, match="heldout"):
        pretrain_small(1, heldout=1.0)


def test_heldout_loss_is_the_mean_over_fixed_windows():
    model = tiny_llama(seed=1, vocab_size=256)
    tokens = byte_tokens("abcdefghij" * 10)
    loss = heldout_loss(model, tokens, seq_len=8, windows=3)
    ids = torch.stack([tokens[i * 8: i * 8 + 9] for i in range(3)])
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
    assert loss == pytest.approx(float(want), rel=1e-6)
    with pytest.raises(ValueError, match="too few"):
        heldout_loss(model, tokens[:5], seq_len=8)


def test_batch_order_walks_epochs():
    order = batch_order(10, 4, 7, seed=3)
    assert [len(b) for b in order] == [4, 4, 2, 4, 4, 2, 4]
    assert sorted(sum(order[:3], [])) == list(range(10)) == sorted(sum(order[3:6], []))
    assert order == batch_order(10, 4, 7, seed=3) != batch_order(10, 4, 7, seed=4)
    with pytest.raises(ValueError):
        batch_order(10, 4, -1)


def test_chunked_sft_loss_equals_the_plain_one(tok):
    model = _tiny_chat_model(tok)
    rows = sft_examples()[:3]
    batch = collate_sft([build_sft_example(tok, r["instruction"], r["answer"]) for r in rows], tok.pad_token_id)
    head = model.lm_head
    hidden = final_hidden_states(model, batch["input_ids"])
    assert model.lm_head is head                      # the head is put back
    assert hidden.shape == batch["input_ids"].shape + (48,)
    with torch.no_grad():
        plain = sft_loss(model(batch["input_ids"]).logits, batch["labels"])
        torch.testing.assert_close(model.lm_head(hidden), model(batch["input_ids"]).logits, rtol=1e-5, atol=1e-5)
    # the same sums in another order (tiles of 4096 columns): float32 rounding, ~1e-6 relative
    assert float(sft_batch_loss(model, batch)) == pytest.approx(float(plain), rel=1e-5)
    with pytest.raises(TypeError, match="LlamaModel"):
        final_hidden_states(torch.nn.Linear(2, 2), batch["input_ids"])


def test_sft_micro_batches_give_the_batch_step(tok):
    rows = sft_examples()[:4]
    runs = []
    for micro in (None, 1):
        model = add_lora(_tiny_chat_model(tok), targets=ALL_PROJECTIONS, r=2, alpha=4)
        logs = sft_lora(model, tok, rows, 1, batch_size=4, micro_batch=micro, lr=1e-2)
        runs.append((logs[0]["loss"], _adapters(model)))
    (loss_full, full), (loss_micro, micro) = runs
    # the token-weighted sum of micro-batch means is the batch mean: equal up to float32 rounding
    assert loss_micro == pytest.approx(loss_full, rel=1e-5)
    for name in full:
        torch.testing.assert_close(micro[name], full[name], rtol=1e-4, atol=1e-6)


def test_sft_lowers_the_loss_and_trains_only_the_adapters(tok):
    model = add_lora(_tiny_chat_model(tok), targets=("q_proj", "v_proj"), r=4, alpha=8)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    rows = sft_examples()[:4]
    logs = sft_lora(model, tok, rows, 12, batch_size=4, micro_batch=2, lr=3e-2, warmup=1)
    assert [r["step"] for r in logs] == list(range(1, 13))
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.5
    assert all(r["tokens"] == logs[0]["tokens"] for r in logs)      # the same 4 examples each step
    for k, v in model.state_dict().items():
        if k in frozen:
            assert torch.equal(v, frozen[k]), f"{k} changed"
    with pytest.raises(ValueError, match="no trainable parameter"):
        sft_lora(_tiny_chat_model(tok), tok, rows, 1)


def test_dpo_starts_at_log_2_and_learns_the_preferences(tok):
    pairs = preference_pairs()[:4]
    model = add_lora(_tiny_chat_model(tok), targets=ALL_PROJECTIONS, r=4, alpha=8)
    logs = dpo_lora(model, tok, pairs, 8, batch_pairs=4, micro_pairs=2, beta=0.5, lr=2e-2, warmup=1)
    first = logs[0]
    # policy = reference before the first update: every log-ratio is 0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["margin"] == 0 and first["accuracy"] == 0
    assert logs[-1]["margin"] > 0 and logs[-1]["loss"] < math.log(2)
    after = preference_eval(model, tok, pairs, beta=0.5)
    # measured after the last update (a step's log is measured before it): the pairs are learnt
    assert after["accuracy"] == 1.0 and after["margin"] > 0 and after["loss"] < math.log(2) / 2


def test_dpo_micro_batches_give_the_batch_step(tok):
    pairs = preference_pairs()[:4]
    states = []
    for micro in (None, 1):
        model = add_lora(_tiny_chat_model(tok), targets=ALL_PROJECTIONS, r=2, alpha=4)
        dpo_lora(model, tok, pairs, 2, batch_pairs=4, micro_pairs=micro, lr=1e-2)
        states.append(_adapters(model))
    for name in states[0]:
        torch.testing.assert_close(states[1][name], states[0][name], rtol=1e-4, atol=1e-6)


def test_greedy_answers(tok):
    model = _tiny_chat_model(tok)
    answers = greedy_answers(model, tok, ["What is a token?", "Name a colour."], max_new_tokens=3)
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    assert answers[0] == greedy_answers(model, tok, ["What is a token?"], max_new_tokens=3)[0]
    with pytest.raises(ValueError, match="instructions"):
        greedy_answers(model, tok, "What is a token?")
