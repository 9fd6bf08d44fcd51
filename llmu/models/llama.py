"""A Llama-family decoder assembled from llmu's parts.

The model, from token ids to next-token logits::

    x = embed_tokens[ids]                                 (B, T, d)
    for each of the L layers:
        x = x + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   n = rms_norm(x)
        x = x + down_proj(silu(gate_proj(n)) * up_proj(n))                         n = rms_norm(x)
    logits = lm_head(rms_norm(x))                         (B, T, vocab)

Module names follow Hugging Face's ``LlamaForCausalLM`` (``layers[i].self_attn.q_proj``,
``layers[i].mlp.gate_proj``, ``layers[i].input_layernorm``, ...), so a learner can rebuild a block
by hand from the same weights and compare. Three parts are pluggable:

- attention: a named backend (``"naive"``, ``"sdpa"``, ``"flash"`` once ``llmu.flash`` is
  imported), see ``llmu.models.backends``; switch with ``model.set_attention(name)``;
- KV cache: ``model(ids, cache=KVCache.for_model(model))`` stores keys and values as it goes, and
  the next call continues at position ``cache.length``. A paged cache (module 09) serves many
  sequences at once: ``model(ids, positions=..., cache=paged_batch, logits_at=...)`` takes their
  new tokens packed in one row, and the batch stores keys and values in its blocks and attends
  through the block tables itself (``llmu.paged.PagedBatch``);
- weight format: every projection is a :class:`Linear`; ``model.replace_linears(fn)`` swaps them
  (for a quantized format, say) without touching the rest.

Positions: by default RoPE rotates queries and keys by their positions (``config.rope_layout``
says which channels pair up); ``LlamaConfig(position_embedding="none")`` builds a NoPE model that
rotates nothing. A batch whose rows start at different positions (left padding) passes
``position_ids`` ``(B, T)`` and an ``attention_mask`` that hides the padding (see
:meth:`LlamaModel.forward`). The default call (no ``position_ids``, no mask) decides this once per
forward pass and runs exactly the tensor operations it always did.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmu.attention.reference import check_attention_mask
from llmu.layers.reference import apply_rope, rms_norm, rope_angles, silu_mul
from llmu.models.backends import get_attention_backend
from llmu.models.cache import KVCache
from llmu.models.config import LlamaConfig


def llama3_inv_freq(head_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """RoPE frequencies of Llama 3.1/3.2, stretched for a longer context (float64, ``(head_dim/2,)``, CPU).

    Slow pairs (wavelength longer than ``original_max_position_embeddings / low_freq_factor``) are
    slowed down ``factor`` times, fast pairs (shorter than ``.. / high_freq_factor``) are kept, and
    the ones in between are interpolated.
    """
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


#: Decode on a CPU: a product ``x W^T`` of a few rows (a GEMV, or the handful of rows a
#: speculative verification or a small batch feeds) is split over torch's threads (see
#: :func:`_gemv_in_blocks`). ``False`` turns that off (to measure what it buys).
SPLIT_GEMV = True
#: The most rows of ``x`` that are split so; more rows are a GEMM, which the BLAS spreads itself.
SPLIT_GEMV_MAX_ROWS = 8
_SPLIT_GEMV_MIN_WEIGHTS = 1 << 16   # below this a weight is read in microseconds: not worth two threads


def _gemv_blocks(x: torch.Tensor, w: torch.Tensor) -> int:
    """How many row blocks :func:`_gemv_in_blocks` should use for ``x W^T`` (1: use ``F.linear``).

    Only for at most :data:`SPLIT_GEMV_MAX_ROWS` rows of input on a CPU, outside autograd, with two
    or more torch threads, a contiguous weight of some size, and a number of blocks that divides
    ``out_features``."""
    if not SPLIT_GEMV or x.device.type != "cpu" or w.device.type != "cpu" or x.dim() == 0:
        return 1
    if x.shape[-1] != w.shape[-1] or x.numel() > SPLIT_GEMV_MAX_ROWS * w.shape[-1]:
        return 1
    if w.dim() != 2 or not w.is_contiguous() or w.numel() < _SPLIT_GEMV_MIN_WEIGHTS or x.dtype != w.dtype:
        return 1
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return 1
    threads = torch.get_num_threads()
    for blocks in range(min(threads, w.shape[0]), 1, -1):
        if w.shape[0] % blocks == 0:
            return blocks
    return 1


def _gemv_in_blocks(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, blocks: int) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for a few rows ``x`` as ``blocks`` products that run on separate threads.

    Decoding one token multiplies one row by every weight matrix: each weight is read once and
    used for one multiply-add per element, so the time is the time to read the weights. On a CPU,
    torch's ``F.linear`` hands such a product to the BLAS as one GEMV on one thread, which reads
    about 10-12 GB/s on the course's 2-core machine, less than half of what two cores can read. Two
    changes fix it:

    1. **Blocks, one per thread.** A batched product over row blocks of ``W`` (a view: no copy)
       is spread over torch's threads, one block each, read by every core at once.
    2. **W on the left.** Each block computes ``W_j x^T`` (a ``(n/blocks, k)`` matrix times a
       ``(k, rows)`` one) rather than ``x W_j^T``: the same dot products, but the BLAS now walks
       ``W``'s rows in the order they lie in memory as the matrix operand it streams, which this
       CPU's BLAS does at close to the rate a plain sum reads memory. With ``W`` on the right it
       read about 16-19 GB/s with 2 threads; on the left, 22-28 GB/s (a plain ``sum`` reads 23-28).

    Measured on the 2-core machine, SmolLM2 in float32, interleaved runs: a decode step went from
    52 ms (``F.linear``) to 34-47 ms (blocks, ``W`` on the right), then to 28-32 ms (``W`` on the
    left), with identical greedy tokens; a verification pass over 5 tokens (module 11) from 66-82 ms
    to 55-64 ms, then 54-58 ms. The result equals ``F.linear``'s to float32 rounding (the order of
    each dot product's sum is the BLAS's choice)."""
    n, k = w.shape
    y = blocked_product(w.view(blocks, n // blocks, k), x.reshape(-1, k), bias)
    return y.reshape(*x.shape[:-1], n)


def blocked_product(w_blocks: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + bias`` for ``x`` ``(rows, k)``, ``W`` given as its row blocks ``(blocks, n / blocks, k)``
    (a view), one block per thread: the product of :func:`_gemv_in_blocks`, for a caller that keeps
    the view (``llmu.models.decode_step``). Returns ``(rows, n)``."""
    blocks, _, k = w_blocks.shape
    rows = x.shape[0]
    y = torch.bmm(w_blocks, x.t().expand(blocks, k, rows))                         # (blocks, n / blocks, rows)
    # -> (rows, n): block j holds outputs j n/blocks .. (j+1) n/blocks - 1; copied row-major, since a
    # column-major view would make the next product's operand transposed (MKL then ran 5x slower)
    y = y.view(1, -1) if rows == 1 else y.permute(2, 0, 1).contiguous().view(rows, -1)
    return y + bias if bias is not None else y


class Linear(nn.Module):
    """``y = x W^T`` with ``W`` of shape ``(out_features, in_features)``, like ``nn.Linear`` without bias.

    Every projection of the model is one of these: the one place a later module changes to store
    weights differently (int8, int4, GGUF blocks). A replacement only needs ``in_features``,
    ``out_features`` and ``forward(x)``.
    """

    def __init__(self, in_features: int, out_features: int, *, weight: torch.Tensor | None = None,
                 bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if weight is None:
            weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
        elif tuple(weight.shape) != (out_features, in_features):
            raise ValueError(f"weight must be ({out_features}, {in_features}), got {tuple(weight.shape)}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=weight.dtype, device=weight.device),
                                     requires_grad=False)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = _gemv_blocks(x, self.weight)
        if blocks > 1:
            return _gemv_in_blocks(x, self.weight, self.bias, blocks)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dtype={self.weight.dtype}")


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (``llmu.layers.reference.rms_norm``). The gain is
    frozen, as every weight of a loaded model is, unless ``requires_grad`` (a model built to train)."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype=None, device=None, requires_grad: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary position embeddings (or none, for a NoPE config)."""

    def __init__(self, config: LlamaConfig, layer_idx: int, dtype=None, device=None):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rope_layout = c.rope_layout
        self.rotary = c.position_embedding == "rope"   # False: NoPE, q and k are not rotated
        self.scale = 1.0 / math.sqrt(c.head_dim)
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        kw = dict(dtype=dtype, device=device)
        self.q_proj = Linear(c.hidden_size, q_dim, bias=c.attention_bias, **kw)
        self.k_proj = Linear(c.hidden_size, kv_dim, bias=c.attention_bias, **kw)
        self.v_proj = Linear(c.hidden_size, kv_dim, bias=c.attention_bias, **kw)
        self.o_proj = Linear(q_dim, c.hidden_size, bias=c.attention_out_bias, **kw)

    def forward(self, x, cos, sin, *, backend, cache: KVCache | None = None, mask: torch.Tensor | None = None,
                return_weights: bool = False):
        """``x`` ``(B, T, d)``; ``cos``/``sin`` ``(T, D/2)`` or per row ``(B, 1, T, D/2)`` (ignored
        with NoPE); ``mask``: None (causal attention) or bool, True = attend, broadcastable to
        ``(B, H, T, T_total)``, ANDed with the causal mask. Returns ``(out, weights or None)``."""
        b, t, _ = x.shape
        # 1. project, and split the channels into heads: (B, T, H*D) -> (B, H, T, D)
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # 2. rotate queries and keys by their positions (NoPE: leave them as they are)
        if self.rotary:
            q = apply_rope(q, cos, sin, self.rope_layout)
            k = apply_rope(k, cos, sin, self.rope_layout)
        # 3. keys and values of the past come from the cache, this call's are added to it
        if cache is not None and getattr(cache, "attends", False):
            # a paged batch (module 09): the tokens belong to several sequences, each with its own
            # past in the block pool; the batch stores k, v at their slots and attends itself
            if return_weights:
                raise ValueError("a paged batch cannot return attention weights")
            if mask is not None:
                raise ValueError("a paged batch takes no mask: it knows which sequence each token belongs to")
            out = cache.attend(self.layer_idx, q, k, v, scale=self.scale)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)), None
        if cache is not None:
            k, v = cache.append(self.layer_idx, k, v)
        # 4. attend (causal: position i sees positions <= i), merge the heads, project back
        weights = None
        if mask is not None:
            # a backend is only handed mask= when there is one (older backends lack the parameter)
            out = backend.fn(q, k, v, causal=True, mask=mask, scale=self.scale, return_weights=return_weights)
            if return_weights:
                out, weights = out
        elif return_weights:
            out, weights = backend.fn(q, k, v, causal=True, scale=self.scale, return_weights=True)
        else:
            out = backend.fn(q, k, v, causal=True, scale=self.scale)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out), weights


class MLP(nn.Module):
    """The SwiGLU feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: LlamaConfig, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, **kw)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, **kw)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, **kw)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """One pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig, layer_idx: int, dtype=None, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, layer_idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config, dtype, device)

    def forward(self, x, cos, sin, *, backend, cache=None, mask=None, return_weights=False):
        h, weights = self.self_attn(self.input_layernorm(x), cos, sin, backend=backend, cache=cache, mask=mask,
                                    return_weights=return_weights)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, weights


@dataclass
class ModelOutput:
    """What a forward pass returns.

    ``logits``: ``(B, T, vocab)`` (``(B, 1, vocab)`` with ``last_only``);
    ``hidden_states``: the embeddings and the output of each layer, the last one after the final
    norm (as in Hugging Face), ``num_layers + 1`` tensors of ``(B, T, d)``;
    ``attentions``: per layer, the ``(B, H, T, T_total)`` attention probabilities.
    """

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    cache: KVCache | None = None


class LlamaModel(nn.Module):
    """A Llama-family decoder-only language model (embeddings, ``L`` blocks, final norm, LM head)."""

    def __init__(self, config: LlamaConfig, *, attention: str = "sdpa", dtype=torch.float32, device=None):
        super().__init__()
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, device) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        if c.tie_word_embeddings:
            # the output projection *is* the embedding matrix: one tensor, two uses
            self.lm_head = Linear(c.hidden_size, c.vocab_size, weight=self.embed_tokens.weight)
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, dtype=dtype, device=device)
        self.set_attention(attention)
        self._rope = (None, None)

    # -- pluggable parts ------------------------------------------------------------------------
    def set_attention(self, name: str) -> LlamaModel:
        """Use the attention backend registered as ``name`` from now on."""
        self.attention_backend = get_attention_backend(name)
        return self

    @property
    def attention(self) -> str:
        return self.attention_backend.name

    def replace_linears(self, fn: Callable[[str, nn.Module], nn.Module]) -> LlamaModel:
        """Replace every projection ``m`` (named ``name``) of the blocks by ``fn(name, m)``.

        The LM head is left alone when it is tied to the embeddings. Returns the model.
        """
        for name, module in list(self.named_modules()):
            for child_name, child in list(module.named_children()):
                full = f"{name}.{child_name}" if name else child_name
                if isinstance(child, Linear) and not (full == "lm_head" and self.config.tie_word_embeddings):
                    setattr(module, child_name, fn(full, child))
        return self

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """An empty :class:`KVCache` for this model."""
        return KVCache.for_model(self, batch_size, max_len)

    # -- helpers --------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def rope_tables(self, start: int, length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """cos and sin for positions ``start .. start+length-1``, ``(length, head_dim/2)`` each;
        ``(None, None)`` for a NoPE model (``position_embedding="none"``: nothing is rotated).

        Computed once (in float64, then rounded) for the model's context and sliced afterwards.
        """
        if self.config.position_embedding != "rope":
            return None, None
        need = start + length
        cos, sin = self._rope
        if cos is None or cos.shape[0] < need or cos.device != self.device:
            self._rope = self._compute_rope(max(need, min(self.config.max_position_embeddings, 4096)))
            cos, sin = self._rope
        return cos[start:need], sin[start:need]

    def _rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """cos and sin gathered at integer ``positions`` (any shape ``S``): ``S + (head_dim/2,)`` each."""
        cos, sin = self.rope_tables(0, int(positions.max()) + 1)
        if cos is None:
            return None, None
        return cos[positions], sin[positions]

    def _attention_mask(self, mask, batch: int, t: int, past: int) -> torch.Tensor:
        """``attention_mask`` checked and shaped for the backends: ``(B, 1, 1, Tk)`` or as given (4-D)."""
        tk = past + t
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a bool torch.Tensor (True = attend), got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"attention_mask must have dtype torch.bool (True = attend), got {mask.dtype}; "
                            "a 0/1 padding mask m becomes `m.bool()`")
        mask = mask.to(self.device)
        if mask.ndim == 2:
            if tuple(mask.shape) != (batch, tk):
                raise ValueError(f"a 2-D attention_mask marks the keys each row may see: it must be (batch, "
                                 f"cached + new tokens) = {(batch, tk)}, got {tuple(mask.shape)}")
            return mask[:, None, None, :]
        if mask.ndim == 4:
            return check_attention_mask(mask, (batch, self.config.num_attention_heads, t, tk))
        raise ValueError(f"attention_mask must be (batch, keys) = {(batch, tk)} or 4-D, broadcastable to "
                         f"(batch, heads, queries, keys) = {(batch, self.config.num_attention_heads, t, tk)}; "
                         f"got shape {tuple(mask.shape)}")

    @torch.inference_mode(False)
    def _compute_rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # outside inference mode even when called inside it: the tables are kept for later calls,
        # and an inference-mode tensor would break a later forward pass that needs gradients
        positions = torch.arange(n, device=self.device)
        c = self.config
        if c.rope_scaling and c.rope_scaling.get("rope_type", c.rope_scaling.get("type")) == "llama3":
            inv_freq = llama3_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(self.device)
            angles = positions.double()[:, None] * inv_freq
            return angles.cos().float(), angles.sin().float()
        return rope_angles(positions, c.head_dim, c.rope_theta)

    # -- forward --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, *, cache: KVCache | None = None, position: int | None = None,
                output_hidden_states: bool = False, output_attentions: bool = False,
                last_only: bool = False, positions: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> ModelOutput:
        """Logits for every position of ``input_ids`` (``(B, T)`` int64; a 1-D tensor or a list is
        taken as one sequence).

        ``cache``: a :class:`KVCache`; keys and values of these tokens are appended, and attention
        also sees the ones it already holds. ``position``: position of the first token (default:
        ``cache.length``, or 0). ``last_only``: compute logits for the last position only (what
        generation needs; the vocabulary projection is the single largest matmul of this model).
        ``output_attentions`` needs weights from the backend: with one that cannot return them
        (``"sdpa"``) this call uses ``"naive"``.

        Serving (module 09) packs the new tokens of many sequences into one row: ``positions``
        (``(T,)`` ints) gives each token its own position, ``cache`` is then a paged batch
        (``llmu.paged.PagedBatch``) that knows which sequence each token belongs to, and
        ``logits_at`` (``(K,)`` indices into the T tokens) picks the tokens whose logits are needed.

        Rows at different positions (a left-padded batch, rows decoded together from different
        lengths): ``position_ids`` (``(B, T)`` ints >= 0) gives every token of every row its own
        position (RoPE's cos and sin are gathered per row, ``(B, 1, T, head_dim/2)``); it may be
        used with a :class:`KVCache` (keys and values are still appended at ``cache.length``).
        ``attention_mask`` (bool, True = attend) hides keys, on top of the causal mask: ``(B, Tk)``
        says which of the ``Tk = cache.length + T`` keys of each row are real tokens (False for
        padding), a 4-D one broadcastable to ``(B, H, T, Tk)`` is passed to the backend as it is.
        A query that sees no key (a padding token) gets zeros. ``position_ids`` is not derived from
        the mask: pass both. Backends that take no mask (``"flash"``) refuse it.
        """
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        if input_ids.ndim == 1:
            input_ids = input_ids[None]
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        if input_ids.numel() == 0:
            raise ValueError("input_ids is empty")
        input_ids = input_ids.to(self.device)
        t = input_ids.shape[1]
        paged = cache is not None and getattr(cache, "attends", False)
        if position_ids is not None:
            if position is not None or positions is not None:
                raise ValueError("pass one of position, positions and position_ids, not several")
            if paged:
                raise ValueError("a paged batch takes positions= (one row of packed tokens), not position_ids=")
            position_ids = torch.as_tensor(position_ids, device=self.device)
            if tuple(position_ids.shape) != tuple(input_ids.shape) or position_ids.is_floating_point() \
                    or position_ids.dtype == torch.bool:
                raise ValueError(f"position_ids must be integers shaped like input_ids {tuple(input_ids.shape)}, "
                                 f"got {tuple(position_ids.shape)} {position_ids.dtype}")
            if int(position_ids.min()) < 0:
                raise ValueError("position_ids must be >= 0")
            cos, sin = self._rope_at(position_ids)                # (B, T, D/2)
            if cos is not None:
                cos, sin = cos[:, None], sin[:, None]             # (B, 1, T, D/2): shared by the heads
        elif positions is not None:
            if position is not None:
                raise ValueError("pass either position (of the first token) or positions (of every token), not both")
            positions = torch.as_tensor(positions, device=self.device)
            if positions.shape != (t,) or positions.is_floating_point():
                raise ValueError(f"positions must be {t} integers (one per token), got {tuple(positions.shape)} "
                                 f"{positions.dtype}")
            if int(positions.min()) < 0:
                raise ValueError("positions must be >= 0")
            cos, sin = self._rope_at(positions)
        elif paged:
            raise ValueError("a paged batch needs positions= (the position of every packed token)")
        else:
            if position is None:
                position = cache.length if cache is not None else 0
            elif cache is not None and position != cache.length:
                raise ValueError(f"position ({position}) must equal cache.length ({cache.length}) when a cache is used")
            cos, sin = self.rope_tables(position, t)
        if logits_at is not None and (last_only or output_hidden_states):
            raise ValueError("logits_at cannot be combined with last_only or output_hidden_states")
        mask = None
        if attention_mask is not None:
            if paged:
                raise ValueError("a paged batch takes no attention_mask: it knows which sequence each token belongs to")
            mask = self._attention_mask(attention_mask, input_ids.shape[0], t, cache.length if cache is not None else 0)
        backend = self.attention_backend
        if output_attentions and not backend.returns_weights:
            backend = get_attention_backend("naive")

        x = self.embed_tokens(input_ids)
        hidden = [x] if output_hidden_states else None
        attentions = [] if output_attentions else None
        for layer in self.layers:
            x, weights = layer(x, cos, sin, backend=backend, cache=cache, mask=mask, return_weights=output_attentions)
            if output_hidden_states:
                hidden.append(x)
            if output_attentions:
                attentions.append(weights)
        if output_hidden_states:
            x = self.norm(x)
            hidden[-1] = x  # the last hidden state is reported after the final norm
            if last_only:
                x = x[:, -1:]
        else:
            if last_only:
                x = x[:, -1:]  # normalise and project only the position whose logits are wanted
            elif logits_at is not None:
                x = x[:, torch.as_tensor(logits_at, device=x.device)]
            x = self.norm(x)
        logits = self.lm_head(x)
        return ModelOutput(
            logits=logits,
            hidden_states=tuple(hidden) if hidden is not None else None,
            attentions=tuple(attentions) if attentions is not None else None,
            cache=cache,
        )

    def num_parameters(self) -> int:
        """Parameters, counting a tied embedding/LM-head matrix once."""
        seen, total = set(), 0
        for p in self.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel()
        return total

    def extra_repr(self) -> str:
        return (f"attention={self.attention!r}, position_embedding={self.config.position_embedding!r}, "
                f"rope_layout={self.config.rope_layout!r}")


#: The configuration of :func:`tiny_llama`: two layers, six query heads sharing two KV heads.
TINY_CONFIG = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)


def make_trainable(config: LlamaConfig, seed: int = 0, *, std: float = 0.02, device=None,
                   dtype=torch.float32) -> LlamaModel:
    """A ``LlamaModel`` of ``config`` with fresh weights, in train mode with gradients on.

    llmu builds its models for inference (parameters created with ``requires_grad=False``); this is
    the one place that makes one to train from scratch: matrices ``N(0, std²)`` (GPT-2's
    initialisation, ``std = 0.02``) drawn from a generator seeded with ``seed`` in parameter order,
    norm gains 1 and biases 0.
    """
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"config must be an llmu LlamaConfig, got {type(config).__name__}")
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not std > 0:
        raise ValueError(f"std must be a positive number, got {std!r}")
    model = LlamaModel(config, dtype=dtype, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed)   # drawn on the CPU: the same weights on any device
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:                          # biases start at 0, RMSNorm gains at 1
                p.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device="cpu").mul_(std))
    return model.train().requires_grad_(True)


def tiny_llama(seed: int = 0, *, scale: float = 0.2, **overrides) -> LlamaModel:
    """A small decoder with random weights (seeded), in eval mode, on the CPU (move it with ``.to``):
    for tests and quick experiments.

    Weights are ``N(0, scale^2)``, norm gains ``1 + N(0, scale^2)``. ``overrides`` change fields of
    :data:`TINY_CONFIG` (any ``LlamaConfig`` field, such as ``head_dim=16`` or ``eos_token_id=96``).
    """
    model = LlamaModel(LlamaConfig(**{**TINY_CONFIG, **overrides}), device="cpu")
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cpu") * scale + (1.0 if p.ndim == 1 else 0.0))
    return model.eval()
