"""The tokenizer built from GGUF metadata gives transformers' ids and chat prompts."""

from __future__ import annotations

import re

import pytest

import llmu  # noqa: F401
from llmu.models import load_tokenizer, model_path

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "2024 is 12345 items, 3.14159! Call 555-0199.",
    "  multiple   spaces\n\nnewlines\t tab  ",
    "trailing space ",
    "héllo wörld 日本語 🤗 ñ Ωμέγα Привет",
    "def f(x):\n    return x**2  # comment\n",
    "I'm can't we'll they've DON'T",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "a1b2c3 x100 1,000,000.50",
    "",
    " ",
    "\n\n\n",
    "emoji 👩‍👩‍👧 and combining é (e + U+0301)",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    path = model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level BPE is lossless


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure?"}],
    [{"role": "user", "content": "Multi\nline ünïcode"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(tok, hf_tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs
    assert tok.encode(ours) == hf_tok.encode(theirs, add_special_tokens=False)


def test_chat_prompt_shape(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)[0] == 1  # <|im_start|>


def test_special_tokens(tok):
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.special_tokens["<|im_start|>"] == 1 and tok.special_tokens["<|im_end|>"] == 2
    assert len(tok.special_ids) == 17 and len(tok) == 49152
    assert tok.encode("<|im_end|>") == [2]  # matched whole, never split
    assert tok.encode("x", add_special_tokens=True) == [1] + tok.encode("x")


def test_token_strings(tok):
    ids = tok.encode("Hello world")
    assert [tok.token_to_str(i) for i in ids] == ["Hello", " world"]
    assert tok.id_to_token(ids[1]) == "Ġworld"  # the vocabulary spells a space as Ġ
    assert tok.tokenize("Hello world") == ["Hello", " world"]


def test_digits_are_single_tokens(tok):
    """The "smollm" pre-tokenizer splits digits; the vocabulary agrees: no multi-digit tokens,
    and no token glues a space to a digit. That is why transformers' converter, which does not
    split digits, still gives the same ids."""
    vocab = [tok.id_to_token(i) for i in range(len(tok))]
    assert not [t for t in vocab if re.search(r"\d\d", t)]
    assert not [t for t in vocab if re.match(r"Ġ\d", t)]
    assert len(tok.encode("1234567")) == 7


def test_bad_inputs(tok):
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(123)
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with 'role' and 'content'"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(TypeError, match="messages must be a list"):
        tok.apply_chat_template("hello")
