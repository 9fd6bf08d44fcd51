"""Multi-head latent attention as a module: one MLA layer, its latent cache, and its two paths.

:mod:`llmu.gqa.reference` has MLA as functions of an :class:`~llmu.gqa.reference.MLAWeights`.
A model holds a layer as an ``nn.Module`` instead, and runs it two ways:

``MLAAttention.forward(x)`` (prefill, training)
    The whole sequence at once, causal, with the keys and values *rebuilt* per head from the
    latent (the "unabsorbed" form): ``T`` queries share every rebuilt key, so rebuilding once
    costs little next to the attention itself, and each score is a dot product of ``d_h + d_r``
    numbers. It also returns the :class:`LatentCache` of the ``T`` tokens.

``MLAAttention.decode(x_new, cache)`` (one new token)
    The up-projections *absorbed*: ``W_UK,h`` moves into the query (``q_c,h W_UK,h^T``, ``d_c``
    numbers per head) and ``W_UV,h`` to the output side (applied once to the attended latent), so
    the step reads the cache of latents as it is and never builds a key or a value per head.
    Rebuilding them would cost ``T d_c H d_h`` multiply-adds per step, for one query.

:class:`LatentCache` is what a token leaves behind: its latent ``c`` (``d_c`` numbers) and its
rotated RoPE key ``k_r`` (``d_r`` numbers, shared by all heads), nothing per head. This is the
reference of notebook 07's exercise 5 (the learner's ``MyMLA``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from llmu.gqa.reference import MLAWeights
from llmu.layers.reference import apply_rope, rope_angles

__all__ = ["LatentCache", "MLAAttention", "WEIGHT_NAMES"]

#: The projections of an :class:`MLAWeights`, which the module keeps as parameters under these names.
WEIGHT_NAMES = ("w_dkv", "w_uk", "w_uv", "w_q", "w_qr", "w_kr", "w_o")


@dataclass
class LatentCache:
    """The latent KV cache of one MLA layer: ``c (B, T, d_c)`` and the rotated shared RoPE keys
    ``k_r (B, T, d_r)`` of the ``T`` tokens seen so far."""

    c: torch.Tensor
    k_r: torch.Tensor

    def __post_init__(self):
        for name in ("c", "k_r"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(getattr(self, name)).__name__}")
        if self.c.ndim != 3 or self.k_r.ndim != 3 or self.c.shape[:2] != self.k_r.shape[:2]:
            raise ValueError(f"c and k_r must be (B, T, d_c) and (B, T, d_r) with one B and T, "
                             f"got {tuple(self.c.shape)} and {tuple(self.k_r.shape)}")

    def __len__(self) -> int:
        return self.c.shape[1]

    @property
    def batch(self) -> int:
        return self.c.shape[0]

    def numel(self) -> int:
        """Numbers held: ``B * T * (d_c + d_r)``."""
        return self.c.numel() + self.k_r.numel()

    def append(self, c: torch.Tensor, k_r: torch.Tensor) -> LatentCache:
        """A cache with ``c (B, n, d_c)`` and ``k_r (B, n, d_r)`` after the entries of this one."""
        return LatentCache(torch.cat([self.c, c], dim=1), torch.cat([self.k_r, k_r], dim=1))


class MLAAttention(nn.Module):
    """One MLA layer built from an :class:`MLAWeights` (whose tensors are copied into parameters of
    the same names, ``x @ W`` convention).

    ``out, cache = layer(x)``: ``x (B, T, d_model)`` at positions ``0 .. T-1``, causal; ``out`` is
    ``(B, T, d_model)`` and ``cache`` the :class:`LatentCache` of the ``T`` tokens.
    ``out, cache = layer.decode(x_new, cache)``: one token ``x_new (B, 1, d_model)`` at position
    ``len(cache)``; ``out (B, 1, d_model)`` and the cache with it appended (a new object).
    """

    def __init__(self, weights: MLAWeights):
        super().__init__()
        if not isinstance(weights, MLAWeights):
            raise TypeError(f"weights must be an llmu.gqa.reference.MLAWeights, got {type(weights).__name__}")
        for name in WEIGHT_NAMES:
            setattr(self, name, nn.Parameter(getattr(weights, name).detach().clone()))
        self.n_heads, self.head_dim = weights.n_heads, weights.head_dim
        self.rope_dim, self.latent_dim = weights.rope_dim, weights.latent_dim
        self.rope_base = float(weights.rope_base)
        self.scale = 1.0 / math.sqrt(self.head_dim + self.rope_dim)   # a score adds d_h + d_r products

    @property
    def d_model(self) -> int:
        return self.w_dkv.shape[0]

    def to_weights(self) -> MLAWeights:
        """The layer's current parameters as an :class:`MLAWeights` (detached copies)."""
        return MLAWeights(*(getattr(self, n).detach().clone() for n in WEIGHT_NAMES), n_heads=self.n_heads,
                          head_dim=self.head_dim, rope_dim=self.rope_dim, rope_base=self.rope_base)

    def empty_cache(self, batch: int) -> LatentCache:
        """A cache of ``T = 0`` tokens for ``batch`` sequences: ``decode`` on it is a 1-token prefill."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        w = self.w_dkv
        return LatentCache(w.new_zeros(batch, 0, self.latent_dim), w.new_zeros(batch, 0, self.rope_dim))

    # -- the parts both paths share ---------------------------------------------------------------

    def _check_x(self, x, name: str, tokens: int | None = None) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        n = "n >= 1" if tokens is None else str(tokens)
        if x.ndim != 3 or x.shape[1] == 0 or x.shape[2] != self.d_model or (tokens is not None and x.shape[1] != tokens):
            raise ValueError(f"{name} must be (B, {n}, d_model = {self.d_model}), got {tuple(x.shape)}")

    def _rope(self, x, positions):
        cos, sin = rope_angles(positions, self.rope_dim, self.rope_base)
        return apply_rope(x, cos.to(x.device, x.dtype), sin.to(x.device, x.dtype))

    def _latent(self, x, positions):
        """What the cache keeps for ``x (B, n, d_model)``: ``c (B, n, d_c)``, ``k_r (B, n, d_r)``."""
        return x @ self.w_dkv, self._rope(x @ self.w_kr, positions)

    def _queries(self, x, positions):
        """``q_c (B, H, n, d_h)`` and the rotated ``q_r (B, H, n, d_r)``."""
        b, n, _ = x.shape
        q_c = (x @ self.w_q).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        q_r = (x @ self.w_qr).view(b, n, self.n_heads, self.rope_dim).transpose(1, 2)
        return q_c, self._rope(q_r, positions)

    def _per_head(self, w):
        """``(d_c, H d_h)`` -> ``(H, d_c, d_h)``: head ``h`` owns columns ``[h d_h, (h+1) d_h)``."""
        return w.view(self.latent_dim, self.n_heads, self.head_dim).permute(1, 0, 2)

    # -- prefill / training: keys and values rebuilt ----------------------------------------------

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, LatentCache]:
        self._check_x(x, "x")
        b, t, _ = x.shape
        positions = torch.arange(t, device=x.device)
        c, k_r = self._latent(x, positions)                                          # (B,T,d_c), (B,T,d_r)
        q_c, q_r = self._queries(x, positions)
        k_c = (c @ self.w_uk).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B,H,T,d_h)
        v = (c @ self.w_uv).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)    # (B,H,T,d_h)
        # head h's key is [k_c_h ; k_r]: its score is the sum of two dot products
        scores = (q_c @ k_c.transpose(-1, -2) + q_r @ k_r[:, None].transpose(-1, -2)) * self.scale
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        out = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v      # (B,H,T,d_h)
        return out.transpose(1, 2).reshape(b, t, -1) @ self.w_o, LatentCache(c, k_r)

    # -- decode: weights absorbed, the cache read as it is ----------------------------------------

    def decode(self, x_new: torch.Tensor, cache: LatentCache) -> tuple[torch.Tensor, LatentCache]:
        if not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a LatentCache, got {type(cache).__name__}")
        self._check_x(x_new, "x_new", tokens=1)
        b = x_new.shape[0]
        if cache.batch != b or cache.c.shape[2] != self.latent_dim or cache.k_r.shape[2] != self.rope_dim:
            raise ValueError(f"cache must be ({b}, T, d_c = {self.latent_dim}) and ({b}, T, d_r = {self.rope_dim}), "
                             f"got {tuple(cache.c.shape)} and {tuple(cache.k_r.shape)}")
        t = len(cache)
        position = torch.arange(t, t + 1, device=x_new.device)
        cache = cache.append(*self._latent(x_new, position))                          # T + 1 tokens
        q_c, q_r = self._queries(x_new, position)                                     # (B,H,1,d_h), (B,H,1,d_r)
        q_lat = q_c @ self._per_head(self.w_uk).transpose(-1, -2)                     # (B,H,1,d_c): W_UK absorbed
        scores = (q_lat @ cache.c[:, None].transpose(-1, -2)
                  + q_r @ cache.k_r[:, None].transpose(-1, -2)) * self.scale          # (B,H,1,T+1)
        o_lat = torch.softmax(scores, dim=-1) @ cache.c[:, None]                      # (B,H,1,d_c)
        o = o_lat @ self._per_head(self.w_uv)                                         # (B,H,1,d_h): W_UV after the sum
        return o.transpose(1, 2).reshape(b, 1, -1) @ self.w_o, cache
