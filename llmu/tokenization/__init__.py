"""Tokenization: text to token ids and back, with byte-level BPE (module 01's first half).

- :mod:`~llmu.tokenization.pretokenize`: GPT-2's pre-tokenisation pattern, SmolLM2's variant
  (digits one by one), and cutting out special tokens (the longest first);
- :mod:`~llmu.tokenization.train_bpe`: learning the merges from a text, with the incremental
  pair-count update and deterministic ties (the lexicographically greatest pair);
- :mod:`~llmu.tokenization.bpe`: :class:`BPETokenizer`, built from ``(vocab, merges,
  special_tokens)``: ``encode``, ``decode`` and a streaming ``encode_iterable``;
- :mod:`~llmu.tokenization.byte_alphabet`: GPT-2's printable stand-ins for the 256 bytes, as
  vocabulary files write tokens;
- :mod:`~llmu.tokenization.smollm2`: SmolLM2's own vocabulary and merges, loaded into
  :class:`BPETokenizer` (the oracle the tests compare with).
"""

from llmu.tokenization.bpe import BPETokenizer
from llmu.tokenization.byte_alphabet import bytes_to_token, bytes_to_unicode, token_to_bytes
from llmu.tokenization.pretokenize import GPT2_PATTERN, pretokenize_gpt2, pretokenize_smollm2, split_special_tokens
from llmu.tokenization.smollm2 import smollm2_tokenizer, smollm2_vocab_merges
from llmu.tokenization.train_bpe import count_words, initial_vocab, train_bpe, train_bpe_from_file

__all__ = ["BPETokenizer", "train_bpe", "train_bpe_from_file", "count_words", "initial_vocab",
           "GPT2_PATTERN", "pretokenize_gpt2", "pretokenize_smollm2", "split_special_tokens",
           "bytes_to_unicode", "token_to_bytes", "bytes_to_token", "smollm2_tokenizer", "smollm2_vocab_merges"]
