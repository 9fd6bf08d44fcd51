"""SmolLM2's own vocabulary and merges as plain ``(vocab, merges, special_tokens)``: the oracle.

The course's model file stores its tokenizer in the GGUF metadata (see
:mod:`llmu.models.tokenizer`): 49,152 tokens written in GPT-2's byte alphabet
(:mod:`llmu.tokenization.byte_alphabet`), 48,900 merges ``"Ġ t"`` in rank order, and a type per
token, 3 marking the 17 special (control) tokens such as ``<|im_start|>``. Read back as bytes, they
are exactly what :func:`llmu.tokenization.train_bpe` produces, so :class:`BPETokenizer` can load
them: with SmolLM2's pre-tokeniser (digits one by one, then GPT-2's pattern) it encodes text to the
very ids the model was trained on, which the tests check against llmu's ``load_tokenizer()`` and
the ``tokenizers`` library on every text llmu ships.
"""

from __future__ import annotations

import os

from llmu.tokenization.bpe import BPETokenizer
from llmu.tokenization.byte_alphabet import merge_to_bytes, token_to_bytes
from llmu.tokenization.pretokenize import pretokenize_smollm2

__all__ = ["smollm2_vocab_merges", "smollm2_tokenizer"]


def smollm2_vocab_merges(path: str | os.PathLike | None = None
                         ) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]], list[str]]:
    """``(vocab, merges, special_tokens)`` of the GGUF file at ``path`` (the course's SmolLM2 file
    by default): ids -> bytes, merges as pairs of bytes in rank order, the special tokens' text."""
    from llmu.models.gguf_file import GGUFFile  # reads the file with the gguf package
    from llmu.models.tokenizer import CONTROL  # llama.cpp's token type for special (control) tokens

    with (GGUFFile() if path is None else GGUFFile(path)) as f:
        if f.get("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"not a byte-level BPE (gpt2) tokenizer: {f.get('tokenizer.ggml.model')!r}")
        tokens = list(f.get("tokenizer.ggml.tokens"))
        types = list(f.get("tokenizer.ggml.token_type"))
        merge_lines = list(f.get("tokenizer.ggml.merges"))
    specials = [tok for tok, t in zip(tokens, types) if t == CONTROL]
    vocab = {i: (tok.encode("utf-8") if t == CONTROL else token_to_bytes(tok))
             for i, (tok, t) in enumerate(zip(tokens, types))}
    return vocab, [merge_to_bytes(line) for line in merge_lines], specials


def smollm2_tokenizer(path: str | os.PathLike | None = None) -> BPETokenizer:
    """SmolLM2's tokenizer as a :class:`BPETokenizer` (its own pre-tokeniser included)."""
    vocab, merges, specials = smollm2_vocab_merges(path)
    return BPETokenizer(vocab, merges, specials, pretokenizer=pretokenize_smollm2)
