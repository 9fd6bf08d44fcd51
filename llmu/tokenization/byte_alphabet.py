"""GPT-2's byte alphabet: one printable character for each of the 256 byte values.

Vocabulary files (GPT-2's ``vocab.json`` and ``merges.txt``, Hugging Face's ``tokenizer.json``,
the ``tokenizer.ggml.tokens`` of a GGUF file) store byte-level BPE tokens as text. A token is a
byte string that need not be valid UTF-8 (half of a "é"), and bytes such as a space or a newline
would be hard to read or would break the one-merge-per-line format. So each byte gets a stand-in
character: the printable ASCII and Latin-1 bytes stand for themselves (``"a"`` is byte 97), and
the others (control characters, the space, ...) are shifted to the characters from U+0100 on in
order: byte 32 (space) becomes ``"Ġ"`` (U+0120), byte 10 (newline) ``"Ċ"`` (U+010A).

``" the"`` is stored as ``"Ġthe"``; :func:`token_to_bytes` reads it back as ``b" the"``.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["bytes_to_unicode", "unicode_to_bytes", "token_to_bytes", "bytes_to_token", "merge_to_bytes"]


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """Byte value -> its stand-in character (GPT-2's ``bytes_to_unicode``)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)  # the next unused character from U+0100 on
            shift += 1
    return table


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """Stand-in character -> byte value (the inverse of :func:`bytes_to_unicode`)."""
    return {ch: b for b, ch in bytes_to_unicode().items()}


def token_to_bytes(token: str) -> bytes:
    """A token written in the byte alphabet (``"Ġthe"``) as its bytes (``b" the"``)."""
    if not isinstance(token, str):
        raise TypeError(f"token must be a str, got {type(token).__name__}")
    table = unicode_to_bytes()
    try:
        return bytes(table[ch] for ch in token)
    except KeyError as exc:
        raise ValueError(f"token {token!r} has the character {exc.args[0]!r}, which is not in GPT-2's byte "
                         "alphabet") from None


def bytes_to_token(data: bytes) -> str:
    """Bytes (``b" the"``) written in the byte alphabet (``"Ġthe"``)."""
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    table = bytes_to_unicode()
    return "".join(table[b] for b in data)


def merge_to_bytes(merge) -> tuple[bytes, bytes]:
    """One merge as files store it, ``"Ġ t"`` (two tokens and one space) or a pair of str, as the
    pair of byte strings it joins: ``(b" ", b"t")``."""
    if isinstance(merge, str):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"merge {merge!r}: expected two tokens separated by one space")
    elif isinstance(merge, (tuple, list)) and len(merge) == 2:
        parts = list(merge)
    else:
        raise TypeError(f"a merge must be 'left right' or a pair of str, got {merge!r}")
    return token_to_bytes(parts[0]), token_to_bytes(parts[1])
