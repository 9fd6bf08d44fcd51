"""Module 07 in PyTorch: fewer KV heads (MHA -> GQA -> MQA), and a latent KV cache (MLA).

Three ideas, each a few lines:

``pool_kv_heads`` / ``convert_kv_heads``
    Turn a model with ``Hkv`` KV heads into one with fewer by *mean-pooling* the key and value
    projections of consecutive heads, as the GQA paper (Ainslie et al., 2023) does to convert an
    MHA checkpoint before a short uptraining (here: no uptraining, so the perplexity we measure is
    the cost of the conversion alone). ``method="first"`` keeps the first head of each group
    instead, the paper's baseline. Query head ``h`` of a model with ``H`` query heads and ``Hkv``
    KV heads reads KV head ``h // (H / Hkv)``; pooling heads ``[j r, (j+1) r)`` into new head ``j``
    keeps that rule true for the new count ``Hkv / r``.

    RoPE does not get in the way: it rotates the same pairs of dimensions of *every* key head by
    the same angle for a given position, so it is one linear map ``R_t`` applied to each head.
    Averaging the rows of ``k_proj`` of two heads and then rotating gives
    ``R_t ((W_a + W_b)/2) x = (R_t W_a x + R_t W_b x)/2``: the average of the two rotated keys.

``mla_unabsorbed`` / ``mla_absorbed`` / ``mla_decode``
    Multi-head latent attention (DeepSeek-V2): cache one latent ``c = x W_dkv`` of ``d_c`` numbers
    per token (plus one shared RoPE key ``k_r`` of ``d_r`` numbers) instead of ``2 H d_h``. Keys
    and values are rebuilt from the latent, ``k_h = c W_uk[h]``, ``v_h = c W_uv[h]``; at decode
    time ``W_uk[h]`` is absorbed into the query and ``W_uv[h]`` into the output projection, so
    attention runs directly over the cached latents and never materialises ``k`` or ``v``.

``kv_bytes_per_token``
    What each scheme stores per token, over all layers: the number that decides how long a
    context fits in memory and how many bytes every decode step reads.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from llmu.layers.reference import apply_rope, rope_angles

__all__ = [
    "pool_kv_heads",
    "convert_kv_heads",
    "MLAWeights",
    "mla_unabsorbed",
    "mla_absorbed",
    "mla_decode",
    "mla_absorbed_scores",
    "kv_bytes_per_token",
    "kv_cache_table",
    "DEEPSEEK_V2_LIKE",
    "SCHEMES",
]


# ----------------------------------------------------------------------------------------------
# MHA -> GQA -> MQA by pooling KV heads
# ----------------------------------------------------------------------------------------------


def _check_counts(n_heads_in: int, n_heads_out: int) -> int:
    for name, value in (("n_kv_heads", n_heads_in), ("new_kv_heads", n_heads_out)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if n_heads_in % n_heads_out:
        raise ValueError(f"new_kv_heads ({n_heads_out}) must divide n_kv_heads ({n_heads_in}): "
                         "each new KV head replaces a whole group of old ones")
    return n_heads_in // n_heads_out


def pool_kv_heads(w: torch.Tensor, n_kv_heads: int, new_kv_heads: int, method: str = "mean") -> torch.Tensor:
    """Pool the per-head rows of a key or value projection.

    ``w``: ``(n_kv_heads * head_dim, d_in)`` (a ``k_proj``/``v_proj`` weight, rows grouped by head)
    or ``(n_kv_heads * head_dim,)`` (a bias). Returns ``(new_kv_heads * head_dim, ...)`` where new
    head ``j`` is the mean (``method="mean"``) or the first (``method="first"``) of old heads
    ``j*r .. j*r + r - 1``, ``r = n_kv_heads / new_kv_heads``. With ``r = 1`` it returns a copy of
    ``w``.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.ndim not in (1, 2):
        raise ValueError(f"w must be a (heads*head_dim, d_in) weight or a (heads*head_dim,) bias, got {tuple(w.shape)}")
    r = _check_counts(n_kv_heads, new_kv_heads)
    if w.shape[0] % n_kv_heads:
        raise ValueError(f"w has {w.shape[0]} rows, not a multiple of n_kv_heads = {n_kv_heads}")
    if method not in ("mean", "first"):
        raise ValueError(f"method must be 'mean' or 'first', got {method!r}")
    head_dim = w.shape[0] // n_kv_heads
    grouped = w.reshape(new_kv_heads, r, head_dim, *w.shape[1:])  # (new heads, heads per group, D, ...)
    pooled = grouped.mean(dim=1) if method == "mean" else grouped[:, 0]
    return pooled.reshape(new_kv_heads * head_dim, *w.shape[1:]).clone()


def convert_kv_heads(model, new_kv_heads: int, *, method: str = "mean", layers=None):
    """A copy of a ``LlamaModel`` whose attention layers in ``layers`` (default: all) have
    ``new_kv_heads`` KV heads, made with :func:`pool_kv_heads`.

    The copy *shares* every other tensor with ``model`` (no second copy of the embeddings or the
    MLPs); only the pooled ``k_proj``/``v_proj`` are new, and ``model`` is left untouched. Pooling
    only some layers makes a model whose KV-head count differs between layers: its forward pass
    works, but ``new_cache()`` assumes one count, so use it without a cache (as perplexity does).
    """
    from llmu.models.llama import Linear

    n_layers = len(model.layers)
    chosen = list(range(n_layers)) if layers is None else sorted(set(int(i) for i in layers))
    for i in chosen:
        if not 0 <= i < n_layers:
            raise ValueError(f"layer index {i} out of range for a model of {n_layers} layers")
    # deepcopy everything except the tensors: the memo maps each parameter and buffer to itself
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    memo[id(model._rope)] = model._rope
    new = copy.deepcopy(model, memo)
    for i in chosen:
        attn = new.layers[i].self_attn
        old_kv = attn.num_kv_heads
        _check_counts(old_kv, new_kv_heads)
        if attn.num_heads % new_kv_heads:
            raise ValueError(f"new_kv_heads ({new_kv_heads}) must divide the {attn.num_heads} query heads")
        for name in ("k_proj", "v_proj"):
            proj = getattr(attn, name)
            w = pool_kv_heads(proj.weight.data, old_kv, new_kv_heads, method)
            lin = Linear(proj.in_features, w.shape[0], weight=w, bias=proj.bias is not None)
            if proj.bias is not None:
                lin.bias.data.copy_(pool_kv_heads(proj.bias.data, old_kv, new_kv_heads, method))
            setattr(attn, name, lin)
        attn.num_kv_heads = new_kv_heads
    if len(chosen) == n_layers:
        new.config = copy.copy(model.config)
        new.config.num_key_value_heads = new_kv_heads
    return new


# ----------------------------------------------------------------------------------------------
# MLA: multi-head latent attention with decoupled RoPE keys
# ----------------------------------------------------------------------------------------------


@dataclass
class MLAWeights:
    """The projections of one MLA layer (``x @ W`` convention, all ``(in, out)``).

    - ``w_dkv (d_model, d_c)``: down-projection to the cached latent ``c``;
    - ``w_uk, w_uv (d_c, H*d_h)``: up-projections of the latent to keys and values;
    - ``w_q (d_model, H*d_h)``: the queries' content part; ``w_qr (d_model, H*d_r)``: their RoPE part;
    - ``w_kr (d_model, d_r)``: the one RoPE key per token, shared by all heads (it is cached too);
    - ``w_o (H*d_h, d_model)``: the output projection.

    DeepSeek-V2 also compresses the queries through a latent (to save activation memory in
    training); it changes nothing about the KV cache, so this layer leaves it out.
    """

    w_dkv: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    w_q: torch.Tensor
    w_qr: torch.Tensor
    w_kr: torch.Tensor
    w_o: torch.Tensor
    n_heads: int
    head_dim: int
    rope_dim: int
    rope_base: float = 10000.0

    @property
    def latent_dim(self) -> int:
        return self.w_dkv.shape[1]

    @property
    def scale(self) -> float:
        # a score is the sum of a content dot product (d_h terms) and a RoPE one (d_r terms)
        return 1.0 / math.sqrt(self.head_dim + self.rope_dim)

    @classmethod
    def random(cls, d_model: int = 256, n_heads: int = 4, head_dim: int = 32, latent_dim: int = 64,
               rope_dim: int = 16, *, dtype=torch.float64, seed: int = 0) -> MLAWeights:
        g = torch.Generator().manual_seed(seed)

        def w(i, o):
            return (torch.randn(i, o, generator=g, dtype=torch.float64) / math.sqrt(i)).to(dtype)

        h, dh, dr, dc = n_heads, head_dim, rope_dim, latent_dim
        return cls(w(d_model, dc), w(dc, h * dh), w(dc, h * dh), w(d_model, h * dh), w(d_model, h * dr),
                   w(d_model, dr), w(h * dh, d_model), n_heads, head_dim, rope_dim)

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache stores for tokens ``x (B, T, d_model)`` at ``positions (T,)``:
        the latent ``c (B, T, d_c)`` and the rotated shared key ``k_r (B, T, d_r)``."""
        cos, sin = self._rope(positions, x.dtype)
        k_r = apply_rope((x @ self.w_kr)[:, None], cos, sin)[:, 0]
        return x @ self.w_dkv, k_r

    def queries(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_c (B, H, T, d_h)`` (content) and ``q_r (B, H, T, d_r)`` (rotated) for ``x``."""
        b, t, _ = x.shape
        q_c = (x @ self.w_q).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        q_r = (x @ self.w_qr).view(b, t, self.n_heads, self.rope_dim).transpose(1, 2)
        cos, sin = self._rope(positions, x.dtype)
        return q_c, apply_rope(q_r, cos, sin)

    def _rope(self, positions, dtype):
        cos, sin = rope_angles(positions, self.rope_dim, self.rope_base)
        return cos.to(dtype), sin.to(dtype)

    def per_head(self, w: torch.Tensor) -> torch.Tensor:
        """``(d_c, H*d_h)`` -> ``(H, d_c, d_h)``: the up-projection of each head."""
        return w.view(w.shape[0], self.n_heads, self.head_dim).permute(1, 0, 2)


def _causal_softmax(scores: torch.Tensor, q_start: int) -> torch.Tensor:
    tq, tk = scores.shape[-2:]
    i = torch.arange(tq, device=scores.device)[:, None] + q_start
    j = torch.arange(tk, device=scores.device)[None, :]
    return torch.softmax(scores.masked_fill(j > i, float("-inf")), dim=-1)


def mla_unabsorbed(x: torch.Tensor, p: MLAWeights, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Causal MLA over ``x (B, T, d_model)``, the way it is trained: rebuild per-head keys and
    values from the latent, then ordinary attention. Returns ``(B, T, d_model)``."""
    b, t, _ = x.shape
    positions = torch.arange(t) if positions is None else positions
    c, k_r = p.latent(x, positions)                                          # (B,T,d_c), (B,T,d_r)
    q_c, q_r = p.queries(x, positions)                                       # (B,H,T,d_h), (B,H,T,d_r)
    k_c = (c @ p.w_uk).view(b, t, p.n_heads, p.head_dim).transpose(1, 2)     # (B,H,T,d_h)
    v = (c @ p.w_uv).view(b, t, p.n_heads, p.head_dim).transpose(1, 2)       # (B,H,T,d_h)
    # the key of head h is [k_c_h ; k_r]: its score is the sum of the two dot products
    scores = (q_c @ k_c.transpose(-1, -2) + q_r @ k_r[:, None].transpose(-1, -2)) * p.scale
    out = _causal_softmax(scores, 0) @ v                                     # (B,H,T,d_h)
    return out.transpose(1, 2).reshape(b, t, -1) @ p.w_o


def mla_absorbed_scores(q_c: torch.Tensor, q_r: torch.Tensor, c: torch.Tensor, k_r: torch.Tensor,
                        w_uk_heads: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores straight from the cache: ``(q_c_h W_uk_h^T) . c + q_r_h . k_r``, times ``scale``.

    ``q_c (B,H,Tq,d_h)``, ``q_r (B,H,Tq,d_r)``, ``c (B,Tk,d_c)``, ``k_r (B,Tk,d_r)``,
    ``w_uk_heads (H,d_c,d_h)``. Returns ``(B,H,Tq,Tk)``. Since ``k_c = c W_uk_h``,
    ``q_c . k_c = q_c (c W_uk_h)^T = (q_c W_uk_h^T) c^T``: the query moves into latent space once
    per step, and no key is ever rebuilt.
    """
    q_lat = q_c @ w_uk_heads.transpose(-1, -2)                               # (B,H,Tq,d_c)
    return (q_lat @ c[:, None].transpose(-1, -2) + q_r @ k_r[:, None].transpose(-1, -2)) * scale


def _absorbed_attend(q_c, q_r, c, k_r, p: MLAWeights, q_start: int) -> torch.Tensor:
    b, _, tq, _ = q_c.shape
    scores = mla_absorbed_scores(q_c, q_r, c, k_r, p.per_head(p.w_uk), p.scale)
    o_lat = _causal_softmax(scores, q_start) @ c[:, None]                    # (B,H,Tq,d_c): latent values
    # W_uv_h absorbed into the output projection: W_ov_h = W_uv_h W_o_h  (d_c, d_model) per head
    w_o_heads = p.w_o.view(p.n_heads, p.head_dim, -1)                        # (H,d_h,d_model)
    w_ov = p.per_head(p.w_uv) @ w_o_heads                                    # (H,d_c,d_model)
    return torch.einsum("bhtc,hcm->btm", o_lat, w_ov)


def mla_absorbed(x: torch.Tensor, p: MLAWeights, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention as :func:`mla_unabsorbed`, computed over the latents only."""
    t = x.shape[1]
    positions = torch.arange(t) if positions is None else positions
    c, k_r = p.latent(x, positions)
    q_c, q_r = p.queries(x, positions)
    return _absorbed_attend(q_c, q_r, c, k_r, p, 0)


def mla_decode(x_new: torch.Tensor, cache_c: torch.Tensor, cache_kr: torch.Tensor, p: MLAWeights):
    """One decode step with the latent cache: ``x_new (B, 1, d_model)`` at position
    ``T = cache_c.shape[1]``. Appends its latent and RoPE key, attends with absorbed weights,
    returns ``(out (B, 1, d_model), cache_c (B, T+1, d_c), cache_kr (B, T+1, d_r))``."""
    t = cache_c.shape[1]
    pos = torch.arange(t, t + x_new.shape[1])
    c, k_r = p.latent(x_new, pos)
    cache_c, cache_kr = torch.cat([cache_c, c], 1), torch.cat([cache_kr, k_r], 1)
    q_c, q_r = p.queries(x_new, pos)
    return _absorbed_attend(q_c, q_r, cache_c, cache_kr, p, t), cache_c, cache_kr


# ----------------------------------------------------------------------------------------------
# KV bytes per token
# ----------------------------------------------------------------------------------------------

#: DeepSeek-V2-like sizes used by the notebook's table: 60 layers, 128 heads of 128, latent 512,
#: RoPE key 64, bfloat16 (2 bytes); GQA with 8 KV heads (LLaMA-2-70B's choice) for comparison.
DEEPSEEK_V2_LIKE = dict(layers=60, heads=128, head_dim=128, kv_heads=8, latent_dim=512, rope_dim=64,
                        bytes_per_value=2)

SCHEMES = ("MHA", "GQA", "MQA", "MLA")


def kv_bytes_per_token(scheme: str, *, layers: int, heads: int, head_dim: int, kv_heads: int | None = None,
                       latent_dim: int | None = None, rope_dim: int | None = None,
                       bytes_per_value: int = 2) -> int:
    """Bytes of KV cache one token occupies, summed over layers.

    - MHA: a key and a value per head, ``2 * heads * head_dim`` values per layer;
    - GQA: ``2 * kv_heads * head_dim``; MQA: ``2 * head_dim`` (one shared head);
    - MLA: the latent and the shared RoPE key, ``latent_dim + rope_dim`` (no factor 2: the latent
      serves as both key and value source).
    """
    for name, value in dict(layers=layers, heads=heads, head_dim=head_dim, bytes_per_value=bytes_per_value).items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if scheme == "MHA":
        per_layer = 2 * heads * head_dim
    elif scheme == "GQA":
        if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise ValueError(f"GQA needs kv_heads, a positive divisor of heads = {heads}; got {kv_heads!r}")
        per_layer = 2 * kv_heads * head_dim
    elif scheme == "MQA":
        per_layer = 2 * head_dim
    elif scheme == "MLA":
        if not latent_dim or rope_dim is None or latent_dim <= 0 or rope_dim < 0:
            raise ValueError("MLA needs latent_dim > 0 and rope_dim >= 0")
        per_layer = latent_dim + rope_dim
    else:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    return layers * per_layer * bytes_per_value


def kv_cache_table(sizes: dict | None = None, context: int = 128 * 1024, batch: int = 1) -> list[dict]:
    """One row per scheme: bytes per token, and GB (1e9 bytes) for ``batch`` sequences of ``context`` tokens."""
    sizes = dict(DEEPSEEK_V2_LIKE if sizes is None else sizes)
    mha = kv_bytes_per_token("MHA", **sizes)
    rows = []
    for scheme in SCHEMES:
        per_token = kv_bytes_per_token(scheme, **sizes)
        rows.append(dict(scheme=scheme, bytes_per_token=per_token, kib_per_token=per_token / 1024,
                         vs_mha=per_token / mha, cache_gb=per_token * context * batch / 1e9))
    return rows
