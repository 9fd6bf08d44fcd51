"""A contiguous KV cache: the keys and values of every past position, kept so decoding is O(T) per token.

Without a cache, generating token ``t + 1`` recomputes the keys and values of all ``t`` previous
positions in every layer. They never change (a causal model's past does not depend on its
future), so a cache stores them once: per layer, two preallocated tensors of shape
``(batch, n_kv_heads, max_len, head_dim)``, filled left to right. Its size is
``2 * layers * batch * n_kv_heads * max_len * head_dim * bytes_per_value``; module 06 studies it.
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys and values for ``num_layers`` layers.

    ``append(layer, k, v)`` writes the new positions of one layer after the ones it holds and
    returns *views* of everything stored so far for that layer, ready for attention.
    ``length`` is the number of positions every layer holds (where the next token goes).
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 *, dtype: torch.dtype = torch.float32, device=None):
        for name, value in dict(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads,
                                max_len=max_len, head_dim=head_dim).items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._lengths = [0] * num_layers
        self.max_len = max_len

    @classmethod
    def for_model(cls, model, batch_size: int = 1, max_len: int | None = None, *,
                  num_layers: int | None = None) -> KVCache:
        """A cache shaped for ``model`` (its dtype and device); ``max_len`` defaults to its context,
        ``num_layers`` to all its layers (fewer: a draft that runs only the first few)."""
        c = model.config
        p = model.embed_tokens.weight
        return cls(num_layers or c.num_hidden_layers, batch_size, c.num_key_value_heads,
                   max_len or c.max_position_embeddings, c.head_dim, dtype=p.dtype, device=p.device)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def length(self) -> int:
        """Positions stored in every layer (equal in all layers between two forward passes)."""
        return min(self._lengths)

    def __len__(self) -> int:
        return self.length

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` (``(B, Hkv, T, D)``) after layer ``layer``'s positions; return all of them."""
        start = self._lengths[layer]
        t = k.shape[2]
        end = start + t
        if end > self.max_len:
            raise ValueError(f"the KV cache holds max_len={self.max_len} positions; cannot add {t} after {start}")
        ck, cv = self.k[layer], self.v[layer]
        if k.shape[:2] != ck.shape[:2] or k.shape[3] != ck.shape[3] or v.shape != k.shape:
            raise ValueError(
                f"k and v must be (batch={ck.shape[0]}, kv_heads={ck.shape[1]}, T, head_dim={ck.shape[3]}); "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        for name, t in (("k", k), ("v", v)):
            if t.dtype != ck.dtype:  # a silent cast would hide a model/cache mismatch
                raise TypeError(f"{name} has dtype {t.dtype} but the KV cache holds {ck.dtype}")
            if t.device != ck.device:
                raise ValueError(f"{name} is on {t.device} but the KV cache is on {ck.device}")
        ck[:, :, start:end] = k
        cv[:, :, start:end] = v
        self._lengths[layer] = end
        return ck[:, :, :end], cv[:, :, :end]

    def advance(self, length: int) -> None:
        """Mark every layer as holding ``length`` positions, after a caller wrote positions
        ``self.length .. length - 1`` of every layer straight into ``k[layer]`` and ``v[layer]``
        (``llmu.models.decode_step`` does, to skip :meth:`append`'s checks in its hot loop)."""
        if isinstance(length, bool) or not isinstance(length, int) or not self.length <= length <= self.max_len:
            raise ValueError(f"length must be an int in {self.length}..{self.max_len}, got {length!r}")
        self._lengths = [length] * self.num_layers

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values layer ``layer`` holds, ``(B, Hkv, length, D)`` views."""
        n = self._lengths[layer]
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n]

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (to rewind after rejected draft tokens, say)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length must be in 0..{self.length}, got {length}")
        self._lengths = [length] * self.num_layers

    def reset(self) -> None:
        self.crop(0)

    @property
    def nbytes(self) -> int:
        """Bytes allocated (for all ``max_len`` positions, used or not)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def __repr__(self) -> str:
        b, h, n, d = self.k[0].shape
        return (f"KVCache(layers={self.num_layers}, batch={b}, kv_heads={h}, head_dim={d}, "
                f"length={self.length}/{n}, {self.nbytes / 2**20:.1f} MiB)")
