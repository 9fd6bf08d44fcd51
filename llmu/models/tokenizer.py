"""SmolLM2's tokenizer, rebuilt from the GGUF metadata with the ``tokenizers`` library.

The file stores what a byte-level BPE tokenizer needs (the GPT-2 recipe):

- ``tokenizer.ggml.tokens``: the 49152 token strings, written in GPT-2's *byte alphabet*: each of
  the 256 byte values has a printable stand-in character (a space is ``Ġ``, a newline ``Ċ``), so
  that any byte sequence, including broken UTF-8, is a string of visible characters;
- ``tokenizer.ggml.merges``: 48900 merge rules ``"Ġ t"``, ``"i n"``, ... in priority order;
- ``tokenizer.ggml.token_type``: 3 (control) marks special tokens such as ``<|im_start|>``;
- ``tokenizer.ggml.pre = "smollm"``: how text is cut into words before BPE runs.

Encoding text is then: (1) split off special tokens, which are matched whole; (2) pre-tokenize:
split every digit on its own (SmolLM2 was trained so that numbers are read digit by digit), then
apply GPT-2's regex (words with their leading space, runs of punctuation, whitespace) and map each
byte to its stand-in character; (3) inside every piece, apply the merges, best rank first, until
none applies; (4) look the resulting strings up in the vocabulary. Decoding maps the stand-in
characters back to bytes and the bytes to UTF-8 text.

The "smollm" pre-tokenizer is the one of the model's ``tokenizer.json`` (and llama.cpp's
``LLAMA_VOCAB_PRE_TYPE_SMOLLM``): ``Digits(individual_digits=True)`` then ``ByteLevel``.
transformers' GGUF converter does not know the name and keeps plain ``ByteLevel``. That gives the
same ids on most text (the vocabulary has no token with two digits nor a space glued to a digit),
but not everywhere: before a digit, GPT-2's regex alone cuts a run of white space such as
``"\\n\\n"`` into ``"\\n"``, ``"\\n"`` (its ``\\s+(?!\\S)`` leaves the last white-space character for
the digit's word, and ``\\s+`` then takes it alone), while the digits-first split keeps ``"\\n\\n"``
whole, one token. llmu follows the model's own recipe
(``tests/tokenization/test_smollm2_oracle.py`` checks a case where the two differ).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

from tokenizers import AddedToken, Tokenizer as _BackendTokenizer, decoders, models, pre_tokenizers

from llmu.models.gguf_file import GGUFFile

CONTROL = 3  # llama.cpp's token type for special (control) tokens


def _default_system_prompt(template: str | None) -> str | None:
    """The system message a ChatML template inserts when the conversation has none."""
    if not template:
        return None
    match = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, flags=re.S)
    return match.group(1) if match else None


class Tokenizer:
    """Text <-> token ids for SmolLM2 (or any byte-level BPE GGUF), plus its ChatML chat format.

    ``encode`` does not add a BOS token: SmolLM2's file says ``add_bos_token = False``.
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None = None, *,
                 bos_token_id: int | None = None, eos_token_id: int | None = None, pad_token_id: int | None = None,
                 unk_token_id: int | None = None, chat_template: str | None = None, pre: str = "smollm"):
        vocab = {tok: i for i, tok in enumerate(tokens)}
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = _BackendTokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False))
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre == "smollm":
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()
        types = list(token_types) if token_types is not None else [1] * len(tokens)
        self.special_ids = [i for i, t in enumerate(types) if t == CONTROL]
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in self.special_ids])
        self.backend = backend
        self._tokens = list(tokens)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.pad_token_id, self.unk_token_id = pad_token_id, unk_token_id
        self.chat_template = chat_template
        self.default_system_prompt = _default_system_prompt(chat_template)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, f: GGUFFile | None = None) -> Tokenizer:
        """Build the tokenizer from a GGUF file's metadata (the course's model by default)."""
        own = f is None
        f = GGUFFile() if own else f
        try:
            model = f.get("tokenizer.ggml.model")
            if model != "gpt2":
                raise ValueError(f"llmu builds byte-level BPE (gpt2) tokenizers; this file has {model!r}")
            return cls(
                f.get("tokenizer.ggml.tokens"),
                f.get("tokenizer.ggml.merges"),
                f.get("tokenizer.ggml.token_type"),
                bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
                eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
                pad_token_id=f.get("tokenizer.ggml.padding_token_id"),
                unk_token_id=f.get("tokenizer.ggml.unknown_token_id"),
                chat_template=f.get("tokenizer.chat_template"),
                pre=f.get("tokenizer.ggml.pre", "gpt2"),
            )
        finally:
            if own:
                f.close()

    # -- basic properties -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def special_tokens(self) -> dict[str, int]:
        return {self._tokens[i]: i for i in self.special_ids}

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry as stored, in the byte alphabet (``"Ġthe"`` for ``" the"``)."""
        return self._tokens[int(token_id)]

    def token_to_str(self, token_id: int) -> str:
        """The text of one token (``" the"``); a token holding part of a UTF-8 character shows as
        ``"\\ufffd"`` on its own."""
        token_id = int(token_id)
        if token_id in self.special_ids:
            return self._tokens[token_id]
        return self.backend.decode([token_id], skip_special_tokens=False)

    # -- encode / decode ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are kept whole.
        ``add_special_tokens=True`` prepends BOS (SmolLM2 does not use one by default)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def tokenize(self, text: str) -> list[str]:
        """The pieces of ``text`` as readable strings (one per token)."""
        return [self.token_to_str(i) for i in self.encode(text)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)

    # -- chat -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False):
        """Render a conversation in ChatML, the format SmolLM2-Instruct was fine-tuned on::

            <|im_start|>system
            You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
            <|im_start|>user
            What is the capital of France?<|im_end|>
            <|im_start|>assistant

        Each message is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; when the first message is
        not a system message, the template's default system message comes first;
        ``add_generation_prompt`` ends with the opening of the assistant's turn. This is what the
        file's Jinja template computes, written out directly.
        """
        if isinstance(messages, dict) or not isinstance(messages, Sequence) or isinstance(messages, str):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        parts = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
            if i == 0 and message["role"] != "system" and self.default_system_prompt is not None:
                parts.append(f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n")
            parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        text = "".join(parts)
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, special={len(self.special_ids)}, eos={self.eos_token_id})"


@lru_cache(maxsize=1)
def _cached_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf()


def load_tokenizer(path=None) -> Tokenizer:
    """SmolLM2's tokenizer (built once per process for the course's model file)."""
    if path is None:
        return _cached_tokenizer()
    with GGUFFile(path) as f:
        return Tokenizer.from_gguf(f)
