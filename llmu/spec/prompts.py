"""The prompts module 11 measures drafts on: two where the answer copies the prompt, one where it does not.

Speculative decoding pays off when the draft guesses right, and how often it does depends on the
task far more than on the draft's machinery. ``edit`` (rewrite a paragraph with one change) and
``summarise`` (condense it) produce text that re-uses the prompt's own phrases, which prompt lookup
(``NGramDraft``) proposes for free; ``story`` asks for new text, where nothing in the prompt helps.
The notebook, the benchmark entry ``spec_decode`` and ``benchmarks/spec_acceptance.py`` all use
these, so their figures describe the same decoding.
"""

from __future__ import annotations

__all__ = ["PARAGRAPH", "PROMPTS", "prompt_messages", "prompt_ids", "end_token"]

PARAGRAPH = (
    "The kv cache keeps the keys and values of every token the model has already seen, so that a "
    "decode step only has to compute the new token's projections. Without it, each step would "
    "recompute attention inputs for the whole prefix, and the cost of generating n tokens would grow "
    "with the square of n. The price is memory: two tensors per layer, per head, per position."
)

#: name -> the user's message (sent as one chat turn, ChatML, with the assistant's turn opened)
PROMPTS = {
    "edit": "Rewrite the following paragraph, replacing 'kv cache' by 'KV cache':\n\n" + PARAGRAPH,
    "summarise": "Summarise the following paragraph in two sentences:\n\n" + PARAGRAPH,
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def prompt_messages(name: str) -> list[dict]:
    """The chat messages of prompt ``name`` (one of :data:`PROMPTS`)."""
    if name not in PROMPTS:
        raise ValueError(f"prompt must be one of {sorted(PROMPTS)}, got {name!r}")
    return [{"role": "user", "content": PROMPTS[name]}]


def prompt_ids(tokenizer, name: str) -> list[int]:
    """Token ids of prompt ``name`` in SmolLM2's chat format, ending with the assistant's turn."""
    from llmu.models.generate import prompt_to_ids

    return prompt_to_ids(tokenizer, prompt_messages(name))


def end_token(tokenizer) -> int:
    """The id that ends the assistant's turn (``<|im_end|>``): generation stops after it."""
    ids = tokenizer.encode("<|im_end|>")
    if len(ids) != 1:
        raise RuntimeError(f"<|im_end|> should be one special token, got {ids}")
    return ids[0]
