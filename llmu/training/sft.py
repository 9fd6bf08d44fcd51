"""Supervised fine-tuning (SFT): teach a model to answer, with the loss on the answer only.

An instruction-tuned model reads a conversation rendered in its chat template. For SmolLM2 that
is ChatML (``llmu.models.Tokenizer.apply_chat_template``)::

    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user
    Why does bread rise?<|im_end|>
    <|im_start|>assistant
    Yeast ferments sugar and releases carbon dioxide.<|im_end|>

A training example is the whole conversation as tokens, but the model should learn to *write the
answer*, not to predict the system prompt or the question (it will always be given those). So
every token gets a label: the token itself where the assistant speaks — the answer and the
``<|im_end|>`` that ends its turn, which is how the model learns to stop — and ``-100``
everywhere else. ``-100`` is the ``ignore_index`` of ``F.cross_entropy``: those positions add
nothing to the loss nor to the count it is averaged over.

Labels are stored aligned with the inputs (``labels[i]`` is token ``i`` or ``-100``); the loss
shifts them, since the logits at position ``i`` predict token ``i + 1``.

Batches are padded on the right. The model's attention is causal, so a real token never looks at
the pads after it, and pads get label ``-100``: right padding changes neither the logits of the
real tokens nor the loss, and no attention mask is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "SFTExample", "build_sft_example", "check_logits_labels", "collate_sft", "sft_examples", "sft_loss"]

#: label of a position that the loss skips (``F.cross_entropy``'s default ``ignore_index``)
IGNORE_INDEX = -100


@dataclass(frozen=True)
class SFTExample:
    """One conversation as token ids, with ``labels`` = the id where the assistant speaks, -100 elsewhere."""

    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        """How many tokens the loss covers."""
        return sum(label != IGNORE_INDEX for label in self.labels)


def _require_text(name: str, value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{name} must not be empty")
    return value


def build_sft_example(tokenizer, instruction: str, answer: str, *, system: str | None = None,
                      max_length: int | None = None) -> SFTExample:
    """Tokens and labels of one (instruction, answer) exchange in the tokenizer's chat template.

    ``system``: a system message (default: the template's own, as at inference). ``max_length``:
    cut the example to that many tokens (from the end; at least one answer token must remain).

    The prompt (everything up to and including ``<|im_start|>assistant\\n``) is encoded on its own
    and the rest after it, so that the prompt's tokens are exactly those the model reads at
    inference before it starts to answer. The newline the template writes after ``<|im_end|>``
    separates turns; the model never writes it (generation stops at ``<|im_end|>``), so it is
    kept as input but not trained on.
    """
    _require_text("instruction", instruction)
    _require_text("answer", answer)
    if not hasattr(tokenizer, "apply_chat_template") or not hasattr(tokenizer, "encode"):
        raise TypeError(f"tokenizer must have apply_chat_template and encode, got {type(tokenizer).__name__}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                   or max_length < 2):
        raise ValueError(f"max_length must be an int >= 2 or None, got {max_length!r}")

    messages = [{"role": "user", "content": instruction}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": _require_text("system", system)})
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}],
                                         add_generation_prompt=False)
    if not full.startswith(prompt):
        raise ValueError("the chat template does not render the prompt as a prefix of the conversation")
    completion = full[len(prompt):]           # answer + end-of-turn marker (+ separator)

    eot = tokenizer.eos_token_id              # <|im_end|> for SmolLM2
    prompt_ids = tokenizer.encode(prompt)
    completion_ids = tokenizer.encode(completion)
    if eot is None or eot not in completion_ids:
        raise ValueError(f"the assistant's turn must end with the end-of-turn token (id {eot}); the template "
                         f"wrote {completion!r}")
    last = len(completion_ids) - 1 - completion_ids[::-1].index(eot)  # the answer's own <|im_end|>
    trained = completion_ids[:last + 1]
    separator = completion_ids[last + 1:]

    input_ids = prompt_ids + trained + separator
    labels = [IGNORE_INDEX] * len(prompt_ids) + trained + [IGNORE_INDEX] * len(separator)
    if max_length is not None and len(input_ids) > max_length:
        if max_length <= len(prompt_ids):
            raise ValueError(f"max_length={max_length} leaves no answer token (the prompt alone is "
                             f"{len(prompt_ids)} tokens)")
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return SFTExample(input_ids, labels)


def collate_sft(examples: Sequence[SFTExample], pad_token_id: int, *, pad_to_multiple_of: int = 1
                ) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples into ``input_ids`` and ``labels`` (``(B, T)`` int64) and an
    ``attention_mask`` (1 on real tokens, 0 on pads; the loss does not need it, the labels of the
    pads are -100). ``pad_to_multiple_of`` rounds ``T`` up (steady shapes for compiled kernels).
    """
    if not isinstance(examples, Sequence) or not examples:
        raise ValueError("examples must be a non-empty list of SFTExample")
    for i, ex in enumerate(examples):
        if not (hasattr(ex, "input_ids") and hasattr(ex, "labels")):
            raise TypeError(f"examples[{i}] must have input_ids and labels, got {type(ex).__name__}")
        if len(ex.input_ids) != len(ex.labels) or not ex.input_ids:
            raise ValueError(f"examples[{i}] must have as many labels as input_ids (and at least one), got "
                             f"{len(ex.input_ids)} and {len(ex.labels)}")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a token id (int >= 0), got {pad_token_id!r}")
    if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive int, got {pad_to_multiple_of!r}")

    longest = max(len(ex.input_ids) for ex in examples)
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, ex in enumerate(examples):
        n = len(ex.input_ids)
        input_ids[row, :n] = torch.tensor(ex.input_ids, dtype=torch.long)
        labels[row, :n] = torch.tensor(ex.labels, dtype=torch.long)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def check_logits_labels(logits, labels) -> None:
    """``logits`` ``(B, T, V)`` and integer ``labels`` ``(B, T)`` aligned with the inputs, or a
    TypeError/ValueError naming what is wrong (shared by the SFT and DPO losses)."""
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(f"logits and labels must be tensors, got {type(logits).__name__} and {type(labels).__name__}")
    if logits.ndim != 3:
        raise ValueError(f"logits must be (batch, seq, vocab), got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must be (batch, seq) = {tuple(logits.shape[:2])}, got {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be integer token ids, got {labels.dtype}")


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy over the labelled tokens of a batch.

    ``logits``: ``(B, T, V)``; ``labels``: ``(B, T)``, aligned with the inputs. Position ``t``'s
    logits are scored against label ``t + 1``; positions whose next label is ``ignore_index`` are
    skipped. The mean is over all labelled tokens of the batch (a long answer weighs more than a
    short one, as in pretraining).
    """
    check_logits_labels(logits, labels)
    # logits at t predict token t + 1: drop the last logits and the first label
    pred = logits[:, :-1].reshape(-1, logits.shape[-1])
    target = labels[:, 1:].reshape(-1).long()
    if not (target != ignore_index).any():
        raise ValueError("labels hold no trained token (every next-token label is ignore_index)")
    if pred.dtype in (torch.float16, torch.bfloat16):
        pred = pred.float()                    # the log-softmax in float32
    return F.cross_entropy(pred, target, ignore_index=ignore_index)


def sft_examples() -> list[dict[str, str]]:
    """The instruction set shipped with llmu (``llmu/data/sft_examples.json``): a list of
    ``{"instruction": ..., "answer": ...}`` written for this repository."""
    from llmu.data import json as data_json

    rows = data_json("sft_examples")["examples"]
    for i, row in enumerate(rows):
        if set(row) != {"instruction", "answer"}:
            raise ValueError(f"sft_examples.json row {i} must have keys instruction and answer, got {sorted(row)}")
    return rows
