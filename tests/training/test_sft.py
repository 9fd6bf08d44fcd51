"""SFT examples: chat template, labels on the assistant's tokens only, padding, masked loss."""

from __future__ import annotations

import math

import pytest
import torch

from llmu.models import load_tokenizer, tiny_llama
from llmu.training.sft import IGNORE_INDEX, SFTExample, build_sft_example, collate_sft, sft_examples, sft_loss


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()    # SmolLM2's tokenizer and ChatML template (no model weights)


def _trained_ids(example: SFTExample) -> list[int]:
    return [label for label in example.labels if label != IGNORE_INDEX]


def test_mask_covers_exactly_the_answer_and_end_of_turn(tok):
    answer = "Yeast ferments sugar and releases carbon dioxide, so the dough rises."
    ex = build_sft_example(tok, "Why does bread rise?", answer)
    assert len(ex.input_ids) == len(ex.labels)
    # the inputs are the whole conversation, exactly as the template renders it
    conversation = tok.apply_chat_template([{"role": "user", "content": "Why does bread rise?"},
                                            {"role": "assistant", "content": answer}], add_generation_prompt=False)
    assert tok.decode(ex.input_ids) == conversation
    # the trained tokens decode to the answer followed by <|im_end|>, and nothing else
    trained = _trained_ids(ex)
    assert tok.decode(trained) == answer + "<|im_end|>"
    assert trained[-1] == tok.eos_token_id
    # they form one contiguous span, and every label there is the input token itself
    positions = [i for i, label in enumerate(ex.labels) if label != IGNORE_INDEX]
    assert positions == list(range(positions[0], positions[-1] + 1))
    assert all(ex.labels[i] == ex.input_ids[i] for i in positions)
    # what comes before is the prompt the model reads at inference, token for token
    prompt = tok.apply_chat_template([{"role": "user", "content": "Why does bread rise?"}])
    assert ex.input_ids[:positions[0]] == tok.encode(prompt)
    assert ex.num_trained == len(trained)


def test_custom_system_message_is_masked(tok):
    ex = build_sft_example(tok, "Name a colour.", "Blue.", system="Answer in one word.")
    assert tok.decode(ex.input_ids).startswith("<|im_start|>system\nAnswer in one word.<|im_end|>")
    assert tok.decode(_trained_ids(ex)) == "Blue.<|im_end|>"


def test_max_length_truncates_the_answer(tok):
    full = build_sft_example(tok, "Count.", "one two three four five six seven eight nine ten")
    first_trained = full.labels.index(next(label for label in full.labels if label != IGNORE_INDEX))
    cut = build_sft_example(tok, "Count.", "one two three four five six seven eight nine ten",
                            max_length=first_trained + 3)
    assert len(cut) == first_trained + 3 and cut.num_trained == 3
    with pytest.raises(ValueError, match="leaves no answer token"):
        build_sft_example(tok, "Count.", "one two", max_length=first_trained)


def test_shipped_instruction_set(tok):
    rows = sft_examples()
    assert len(rows) == 40
    assert len({r["instruction"] for r in rows}) == len(rows)
    for row in rows:
        ex = build_sft_example(tok, row["instruction"], row["answer"])
        assert tok.decode(_trained_ids(ex)) == row["answer"] + "<|im_end|>"
        assert len(ex) <= 96          # short examples: SFT of the whole set is quick on a CPU


def test_collate_pads_right_with_ignored_labels():
    a = SFTExample([5, 6, 7, 8, 9], [IGNORE_INDEX, IGNORE_INDEX, 7, 8, 9])
    b = SFTExample([5, 6, 3], [IGNORE_INDEX, IGNORE_INDEX, 3])
    batch = collate_sft([a, b], pad_token_id=0, pad_to_multiple_of=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [5, 6, 3, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 8, 9, -100, -100, -100], [-100, -100, 3] + [-100] * 5]
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * 3, [1] * 3 + [0] * 5]
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long


def test_loss_matches_hand_computation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    labels = torch.tensor([[-100, -100, 3, 7, 1], [-100, 4, 9, -100, -100]])
    total, count = 0.0, 0
    for b in range(2):
        for t in range(4):                       # logits at t predict the label at t + 1
            target = int(labels[b, t + 1])
            if target == IGNORE_INDEX:
                continue
            row = logits[b, t].double()
            total += -(row[target] - torch.logsumexp(row, 0)).item()
            count += 1
    assert count == 5
    # float32 log-softmax of 11 values of size ~1: agreement to ~1e-6
    assert sft_loss(logits, labels).item() == pytest.approx(total / count, rel=1e-5)


def test_padding_does_not_change_the_loss():
    model = tiny_llama(seed=0)              # vocabulary of 97: small ids
    a = SFTExample([5, 6, 7, 8, 9, 10], [IGNORE_INDEX] * 3 + [8, 9, 10])
    b = SFTExample([11, 12, 13], [IGNORE_INDEX, 12, 13])
    with torch.no_grad():
        batch = collate_sft([a, b], pad_token_id=1)
        loss_batch = sft_loss(model(batch["input_ids"]).logits, batch["labels"])
        # each example alone, without any padding; the batch mean weighs them by trained tokens
        alone = []
        for ex in (a, b):
            ids = torch.tensor([ex.input_ids])
            alone.append(sft_loss(model(ids).logits, torch.tensor([ex.labels])).item() * ex.num_trained)
        expected = (alone[0] + alone[1]) / (a.num_trained + b.num_trained)   # 3 and 2 tokens
    assert loss_batch.item() == pytest.approx(expected, rel=1e-5)
    # changing what the pads hold changes nothing
    with torch.no_grad():
        other = collate_sft([a, b], pad_token_id=50)
        assert sft_loss(model(other["input_ids"]).logits, other["labels"]).item() == pytest.approx(loss_batch.item(),
                                                                                                    rel=1e-6)


def test_loss_trains_answer_tokens_only():
    """A gradient step on the masked loss raises the answer's probability, and the prompt
    positions contribute no gradient to the loss."""
    model = tiny_llama(seed=0).train().requires_grad_(True)
    ex = SFTExample([3, 14, 15, 92, 65, 35], [IGNORE_INDEX] * 3 + [92, 65, 35])
    batch = collate_sft([ex], pad_token_id=0)
    logits = model(batch["input_ids"]).logits
    logits.retain_grad()
    loss = sft_loss(logits, batch["labels"])
    loss.backward()
    # positions 0 and 1 predict masked labels (tokens 1 and 2); position 5 predicts nothing
    assert torch.count_nonzero(logits.grad[0, [0, 1, 5]]) == 0
    assert torch.count_nonzero(logits.grad[0, 2:5].abs().sum(-1)) == 3
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
        assert sft_loss(model(batch["input_ids"]).logits, batch["labels"]) < loss


def test_bad_inputs(tok):
    with pytest.raises(TypeError, match="instruction must be a str"):
        build_sft_example(tok, None, "x")
    with pytest.raises(ValueError, match="answer must not be empty"):
        build_sft_example(tok, "Question?", "  ")
    with pytest.raises(ValueError, match="max_length"):
        build_sft_example(tok, "Question?", "Yes.", max_length=1)
    with pytest.raises(TypeError, match="tokenizer must have"):
        build_sft_example("tokenizer", "Question?", "Yes.")
    with pytest.raises(ValueError, match="non-empty list"):
        collate_sft([], pad_token_id=0)
    with pytest.raises(ValueError, match="as many labels"):
        collate_sft([SFTExample([1, 2], [1])], pad_token_id=0)
    with pytest.raises(ValueError, match="pad_token_id"):
        collate_sft([SFTExample([1, 2], [1, 2])], pad_token_id=-1)
    logits = torch.randn(1, 4, 7)
    with pytest.raises(ValueError, match="no trained token"):
        sft_loss(logits, torch.full((1, 4), IGNORE_INDEX))
    with pytest.raises(ValueError, match=r"labels must be \(batch, seq\)"):
        sft_loss(logits, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="logits must be"):
        sft_loss(logits[0], torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="labels must be integer"):
        sft_loss(logits, torch.zeros(1, 4))
    assert math.isfinite(sft_loss(logits, torch.tensor([[-100, 1, -100, -100]])).item())
