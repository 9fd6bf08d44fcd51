"""The paged KV cache of the model: a pool of blocks per layer, and one step's batch over it.

:class:`PagedKVCache` holds the tensors (``(num_blocks, block_size, Hkv, D)`` keys and values per
layer); :class:`llmu.paged.BlockManager` decides who owns which block. Each engine step packs the
new tokens of every scheduled sequence into one row and describes them with a
:class:`PagedBatch`: which pool slots the new keys and values go to, and each sequence's block
table, context length and query rows. The model's attention layers hand their ``q, k, v`` to
``PagedBatch.attend``, which stores ``k, v`` at their slots and attends through the block tables::

    pool = PagedKVCache.for_model(model, num_blocks=256)
    batch = pool.batch(block_tables, context_lens, cu_seqlens_q, slots)
    logits = model(ids[None], positions=positions, cache=batch, logits_at=last_rows).logits

Attention runs on one of three implementations (``impl``):

- ``"triton"``: the kernels of ``llmu.paged.kernels`` (the default on a GPU);
- ``"torch"``: gathers each sequence's blocks and calls PyTorch's fused attention (the default on
  a CPU, where Triton only interprets);
- ``"reference"``: ``llmu.paged.reference``, float32 and one sequence at a time, to check the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.attention.reference import causal_mask, grouped_rows_attention
from llmu.paged import reference

__all__ = ["PagedKVCache", "PagedBatch", "DecodeIndex", "torch_paged_attention", "IMPLS"]

IMPLS = ("triton", "torch", "reference")


class DecodeIndex:
    """Where each sequence's context lies in the pool, for steps that decode one token per sequence.

    Every layer of a step reads the same positions of its own pool, so the index is built once per
    step (:class:`PagedBatch` keeps it) and used by all of them. Two ways to read the context:

    - a **view**, when there is one sequence and its blocks are consecutive in the pool (the block
      manager hands out free blocks in order, so a lone sequence's usually are): its keys and
      values are one slice of the pool, read in place, nothing copied;
    - a **gather** otherwise: every sequence's slots in position order, padded to the longest
      context by repeating the sequence's last position (a real, finite row that the mask gives
      weight 0), copied out of the pool in one indexing operation per layer.
    """

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int):
        lens = context_lens.tolist()
        self.batch = len(lens)
        self.view = None  # (first pool row, length) of the single sequence's contiguous context
        if self.batch == 1:
            used = block_tables[0, : -(-lens[0] // block_size)].tolist()
            if all(b - a == 1 for a, b in zip(used, used[1:])):
                self.view = (used[0] * block_size, lens[0])
                return
        device = block_tables.device
        max_len = max(lens)
        lens_t = context_lens.to(device).long()
        pos = torch.minimum(torch.arange(max_len, device=device)[None, :], lens_t[:, None] - 1)  # (B, L)
        self.slots = block_tables.long().gather(1, pos // block_size) * block_size + pos % block_size
        # no mask when every context has the same length: SDPA then takes its unmasked path
        self.mask = None if min(lens) == max_len else \
            (torch.arange(max_len, device=device)[None, :] < lens_t[:, None])[:, None, None, :]

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """``q`` ``(B, H, D)``, one query per sequence, against its context; returns ``(B, H, D)``."""
        nb, bs, hkv, d = k_cache.shape
        b, h, _ = q.shape
        if self.view is not None:
            start, length = self.view
            k = k_cache.view(nb * bs, hkv, d)[start : start + length].transpose(0, 1)  # (Hkv, L, D), a view
            v = v_cache.view(nb * bs, hkv, d)[start : start + length].transpose(0, 1)
            # one query per head, the G heads of a KV head as the rows of one product: two small
            # matmuls and a softmax cost less to call than SDPA (about 20 us against 35-70 a layer)
            return grouped_rows_attention(q.reshape(hkv, h // hkv, d), k, v, scale).reshape(b, h, d)
        k = k_cache.view(nb * bs, hkv, d)[self.slots].transpose(1, 2)  # (B, Hkv, L, D)
        v = v_cache.view(nb * bs, hkv, d)[self.slots].transpose(1, 2)
        # the G query heads of a KV head go through as G "positions" of that head (no repeat of K/V)
        out = F.scaled_dot_product_attention(q.reshape(b, hkv, h // hkv, d), k, v, attn_mask=self.mask, scale=scale)
        return out.reshape(b, h, d)


def _decode_rows(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One query per sequence (``q`` ``(B, H, D)``) against its paged context."""
    return DecodeIndex(block_tables, context_lens, k_cache.shape[1]).attend(q, k_cache, v_cache, scale)


def torch_paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, *, scale,
                          decode_only: bool | None = None):
    """:func:`llmu.paged.reference.paged_prefill_attention` with PyTorch's fused attention.

    Sequences with one new token (decoding) are gathered all at once, padded to the longest
    context and masked; each longer chunk (a prefill) attends on its own. ``q`` ``(N, H, D)``;
    returns ``(N, H, D)``. ``decode_only`` (every sequence has one query) skips the sorting.
    """
    nb, bs, hkv, d = k_cache.shape
    n, h, _ = q.shape
    b = block_tables.shape[0]
    if decode_only is None:
        decode_only = n == b
    if decode_only:
        return _decode_rows(q, k_cache, v_cache, block_tables, context_lens, scale)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    single = [i for i in range(b) if cu[i + 1] - cu[i] == 1]
    if single:
        rows = torch.tensor([cu[i] for i in single], device=q.device)
        idx = torch.tensor(single, device=block_tables.device)
        out[rows] = _decode_rows(q[rows], k_cache, v_cache, block_tables[idx], context_lens[idx], scale)
    for i in range(b):
        s, e, length = cu[i], cu[i + 1], lens[i]
        if e - s == 1 and single:
            continue
        table = block_tables[i, : -(-length // bs)].long()
        k = k_cache[table].flatten(0, 1)[:length].transpose(0, 1)  # (Hkv, L, D)
        v = v_cache[table].flatten(0, 1)[:length].transpose(0, 1)
        qi = q[s:e].transpose(0, 1)  # (H, q_len, D)
        mask = causal_mask(e - s, length, device=q.device) if e - s > 1 else None
        out[s:e] = F.scaled_dot_product_attention(qi[None], k[None], v[None], attn_mask=mask, scale=scale,
                                                  enable_gqa=h != hkv)[0].transpose(0, 1)
    return out


class PagedKVCache:
    """Keys and values of every layer in ``num_blocks`` blocks of ``block_size`` positions."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device=None):
        for name, value in dict(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                                num_kv_heads=num_kv_heads, head_dim=head_dim).items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def block_bytes(model, block_size: int = 16) -> int:
        """Bytes one block takes over all layers: ``2 * layers * block_size * Hkv * D * bytes``."""
        c = model.config
        return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * model.dtype.itemsize

    @classmethod
    def for_model(cls, model, *, num_blocks: int | None = None, memory_bytes: int | None = None,
                  block_size: int = 16) -> PagedKVCache:
        """A pool shaped for ``model``: ``num_blocks`` blocks, or as many as ``memory_bytes`` holds."""
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("give exactly one of num_blocks and memory_bytes")
        if num_blocks is None:
            if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes <= 0:
                raise ValueError(f"memory_bytes must be a positive int, got {memory_bytes!r}")
            num_blocks = memory_bytes // cls.block_bytes(model, block_size)
            if num_blocks < 1:
                raise ValueError(f"memory_bytes={memory_bytes} holds no block of {cls.block_bytes(model, block_size)} bytes")
        c = model.config
        return cls(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim,
                   dtype=model.dtype, device=model.device)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_blocks(self, copies) -> None:
        """Copy block ``src`` to block ``dst`` in every layer, for each ``(src, dst)`` (copy-on-write)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.k[0].device)
        dst = torch.tensor([d for _, d in copies], device=self.k[0].device)
        for t in self.k + self.v:
            t[dst] = t[src]

    def batch(self, block_tables, context_lens, cu_seqlens_q, slots, *, impl: str | None = None) -> PagedBatch:
        return PagedBatch(self, block_tables, context_lens, cu_seqlens_q, slots, impl=impl)

    def __repr__(self) -> str:
        nb, bs, h, d = self.k[0].shape
        return (f"PagedKVCache(layers={self.num_layers}, blocks={nb}x{bs}, kv_heads={h}, head_dim={d}, "
                f"{self.nbytes / 2**20:.1f} MiB)")


class PagedBatch:
    """One step's packed tokens over a :class:`PagedKVCache` (what the model receives as ``cache``).

    ``block_tables`` ``(B, max_blocks)`` and ``context_lens`` ``(B,)``: each sequence's blocks and
    its length *after* this step; ``cu_seqlens_q`` ``(B + 1,)``: its rows among the packed tokens;
    ``slots`` ``(N,)``: the pool row each new token's keys and values go to.
    """

    attends = True  # the model's attention hands q, k, v to attend() instead of calling a backend

    def __init__(self, pool: PagedKVCache, block_tables, context_lens, cu_seqlens_q, slots, *, impl=None):
        device = pool.k[0].device
        as_idx = lambda x, dt: torch.as_tensor(x, dtype=dt, device=device)  # noqa: E731
        self.pool = pool
        self.block_tables = as_idx(block_tables, torch.int32)
        self.context_lens = as_idx(context_lens, torch.int32)
        self.cu_seqlens_q = as_idx(cu_seqlens_q, torch.int32)
        self.slots = as_idx(slots, torch.int64)
        if impl is None:
            impl = "triton" if device.type == "cuda" else "torch"
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self.impl = impl
        n, b = self.slots.shape[0], self.block_tables.shape[0]
        if self.cu_seqlens_q.shape != (b + 1,) or self.context_lens.shape != (b,):
            raise ValueError(f"cu_seqlens_q must have {b + 1} entries and context_lens {b}, got "
                             f"{tuple(self.cu_seqlens_q.shape)} and {tuple(self.context_lens.shape)}")
        self.decode_only = n == b  # one new token per sequence (cu_seqlens_q then is 0, 1, ..., B)
        self._decode_index = None  # built by the first layer that attends, used by every other

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
        """Store ``k``, ``v`` (``(1, Hkv, N, D)``) at their slots, attend ``q`` (``(1, H, N, D)``)."""
        if q.shape[0] != 1 or q.shape[2] != self.slots.shape[0]:
            raise ValueError(f"a paged batch takes its {self.slots.shape[0]} tokens packed in one row, "
                             f"got q of shape {tuple(q.shape)}")
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        # (1, H, N, D) -> (N, H, D): one row per token, as the pool stores them
        q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
        nb, bs, hkv, d = kc.shape
        kc.view(nb * bs, hkv, d).index_copy_(0, self.slots, k)
        vc.view(nb * bs, hkv, d).index_copy_(0, self.slots, v)
        if self.impl == "torch" and self.decode_only:
            if self._decode_index is None:
                self._decode_index = DecodeIndex(self.block_tables, self.context_lens, bs)
            out = self._decode_index.attend(q, kc, vc, scale)
        elif self.impl == "torch":
            out = torch_paged_attention(q, kc, vc, self.block_tables, self.cu_seqlens_q, self.context_lens,
                                        scale=scale, decode_only=self.decode_only)
        elif self.impl == "reference":
            out = reference.paged_prefill_attention(q, kc, vc, self.block_tables, self.cu_seqlens_q,
                                                    self.context_lens, scale=scale)
        else:
            from llmu.paged import kernels

            if self.decode_only:
                out = kernels.paged_decode_attention(q.contiguous(), kc, vc, self.block_tables, self.context_lens,
                                                     scale=scale)
            else:
                out = kernels.paged_prefill_attention(q.contiguous(), kc, vc, self.block_tables, self.cu_seqlens_q,
                                                      self.context_lens, scale=scale)
        return out.transpose(0, 1)[None]  # (1, H, N, D)
