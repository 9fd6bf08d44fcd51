"""A decode step of the stock Llama model in few PyTorch calls: float32, on a CPU.

At batch 1 a decode step multiplies one row by every weight matrix, so its matrix products take
the time it takes to read the weights: about 19-20 ms for SmolLM2-135M's 538 MB of float32 on
the course's 2-core machine. Everything else works on vectors of 576 numbers, and there the cost
is not arithmetic but PyTorch's dispatch, 1-3 us per operation whatever its size. Through the
modules of :mod:`llmu.models.llama` (which stay the readable definition of the model) a step
dispatches 3,413 operations (114 per layer, views included) and Python checks around them, and
they added 6-7 ms to every token; this step dispatches 1,964 (65 per layer). Measured per layer,
in microseconds, on that machine (module path -> this step):

=============================  =======  ========================================================
part                           module   here
=============================  =======  ========================================================
2 RMSNorms (8 ops each)        2 x 22   ``F.rms_norm``, one fused op: 2 x 10
7 projections (checks, views)  7 x 12   ``torch.bmm`` on views made once per generation: 7 x 2
2 RoPE calls (slices, cat)     2 x 15   one call on q and k stacked, with ``cos``/``sin`` tables
                                        built once per step: ``x * cos2 + rotate_half(x) * sin2``
KV cache append (checks)       13       two copies into the cache's tensors at the position
attention (sdpa's dispatch)    22       per key/value head, its query heads as rows: bmm,
                                        softmax, bmm (about 19)
=============================  =======  ========================================================

The arithmetic is the model's: the same weights and the same products (each as the blocked
``W x^T`` of :func:`llmu.models.llama._gemv_in_blocks`), RoPE bit for bit the ``"half"`` layout
of :func:`llmu.layers.reference.apply_rope`; the norms and the attention sum in the order of
their own kernels, so logits agree with the module path to float32 rounding (about 1e-5) and
the greedy tokens are the same.

:func:`llmu.models.generate_ids` uses a :class:`DecodeStep` for every token after the prompt
whenever :func:`unsupported` has nothing against the model (and :data:`ENABLED`); anything the
step does not reproduce exactly sends generation back through the modules: another attention
backend, a replaced projection (int8, LoRA), a hook on any module, a patched ``forward``, another
dtype or device, interleaved RoPE. ``GenerationStats.decode_path`` says which path ran. The
serving engine's runner (module 16) passes its packed paged batches through
:meth:`DecodeStep.packed` the same way (``ModelRunner.step_path``).

**Passes of a few tokens** (speculative verification, module 11) go through the same step. There
the products have 2-8 rows, and this CPU's BLAS (MKL, on an AMD EPYC) does them poorly: on the
course's machine the weights' products took 19.7 ms for 1 row, 20.3 for 2, 26.2 for 4, 33.1 for 5
and 45.6 ms for 7 (interleaved, quiet machine). oneDNN, PyTorch's other CPU library, does them at
the rate of memory (24.5 ms for 5 rows, 26.7 for 7) once each weight has been copied into its own
blocked layout: ``DecodeStep(model, pack=True)`` makes that copy (as many bytes again as the
weights, about 0.4 s for SmolLM2) and uses it for passes of :data:`PACKED_MIN_ROWS` tokens or more.
The copy is taken when the step is built: a step must be built again after the weights change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from llmu.attention.reference import grouped_rows_attention
from llmu.models import backends, llama
from llmu.models.cache import KVCache

__all__ = ["ENABLED", "PACKED_MIN_ROWS", "DecodeStep", "disabled", "packing_fits", "packing_unavailable",
           "unsupported"]

#: Passes of at least this many tokens use the packed weights of ``DecodeStep(model, pack=True)``;
#: below it the split BLAS product is as fast (the module's docstring).
PACKED_MIN_ROWS = 4

#: ``False`` sends every decode step of ``generate_ids`` through the modules (to compare the two).
ENABLED = True


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside the block, generation decodes through the modules (``with disabled(): ...``): to time
    what the step buys, or to compare two models on the same path (the step takes float32 only)."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before


# The stock classes and functions the step reproduces, captured when llmu is imported: a learner
# who later patches one (``Attention.forward = mine``) gets the modules, which run the patch.
_STOCK_FORWARD = {cls: cls.forward for cls in (llama.LlamaModel, llama.DecoderLayer, llama.Attention, llama.MLP,
                                                 llama.RMSNorm, llama.Linear, nn.Embedding)}
_STOCK_FUNCTIONS = {name: getattr(llama, name) for name in ("rms_norm", "apply_rope", "silu_mul", "_gemv_in_blocks")}
_STOCK_ATTENTION = (backends.sdpa_attention, backends.naive_attention)


def _stock(module: nn.Module, cls: type) -> str | None:
    if type(module) is not cls:
        return f"{type(module).__name__} is not llmu's {cls.__name__}"
    if cls.forward is not _STOCK_FORWARD[cls] or "forward" in vars(module):
        return f"{cls.__name__}.forward has been replaced"
    return None


def unsupported(model, cache: KVCache | None = None) -> str | None:
    """Why a :class:`DecodeStep` cannot decode ``model`` (with ``cache``), as a sentence; ``None`` when it can."""
    if not isinstance(model, llama.LlamaModel):
        return f"the model is a {type(model).__name__}, not a LlamaModel"
    c = model.config
    if model.device.type != "cpu":
        return f"the model is on {model.device}; the step is written for a CPU"
    if model.dtype != torch.float32:
        return f"the model holds {model.dtype}; the step reproduces float32 only"
    if c.position_embedding == "rope" and c.rope_layout != "half":
        return f"rope_layout is {c.rope_layout!r}; the step rotates the 'half' layout only"
    if model.attention_backend.fn not in _STOCK_ATTENTION:
        return f"attention backend {model.attention!r} is not one of the stock 'naive' and 'sdpa'"
    for name, fn in _STOCK_FUNCTIONS.items():
        if getattr(llama, name) is not fn:
            return f"llmu.models.llama.{name} has been replaced"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "a global forward hook is registered"
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{name or 'the model'} has a forward hook"
    checks = [(model, llama.LlamaModel), (model.embed_tokens, nn.Embedding), (model.norm, llama.RMSNorm),
              (model.lm_head, llama.Linear)]
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        checks += [(layer, llama.DecoderLayer), (a, llama.Attention), (m, llama.MLP),
                   (layer.input_layernorm, llama.RMSNorm), (layer.post_attention_layernorm, llama.RMSNorm)]
        checks += [(p, llama.Linear) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                                m.down_proj)]
    for module, cls in checks:
        why = _stock(module, cls)
        if why is not None:
            return why
    if cache is not None:
        if type(cache) is not KVCache:
            return f"the cache is a {type(cache).__name__}, not a KVCache"
        if cache.k[0].shape[0] != 1:
            return f"the cache holds a batch of {cache.k[0].shape[0]}; the step decodes one sequence"
    return None


def packing_unavailable() -> str | None:
    """Why ``DecodeStep(model, pack=True)`` cannot pack weights here, or ``None`` when it can: it
    needs PyTorch's oneDNN (``torch.backends.mkldnn``) and its linear ops."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch has no oneDNN (torch.backends.mkldnn)"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return "this PyTorch lacks torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise"
    return None


def packing_fits(model) -> bool:
    """Whether the memory available now holds a packed copy of ``model``'s weights twice over
    (Linux: ``MemAvailable`` of ``/proc/meminfo``; elsewhere, assumed). A notebook on a small
    machine (Binder) then verifies with the unpacked products rather than risk running out."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return True
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return available >= 2 * weights


def _pack(w: torch.Tensor) -> torch.Tensor:
    """``w`` copied into oneDNN's blocked layout for products of up to 8 rows."""
    return torch.ops.mkldnn._reorder_linear_weight(w, llama.SPLIT_GEMV_MAX_ROWS)


class _Projection:
    """``x W^T + b`` for a few rows ``x`` ``(T, k)``: the weight's row-block view is made once, and
    with ``pack`` a oneDNN copy of the weight for passes of :data:`PACKED_MIN_ROWS` rows or more."""

    __slots__ = ("weight", "bias", "blocks", "view", "packed")

    def __init__(self, linear: llama.Linear, pack: bool = False):
        w = linear.weight
        self.weight, self.bias = w, linear.bias
        self.blocks = llama._gemv_blocks(torch.empty(1, w.shape[1], dtype=w.dtype), w)
        self.view = w.view(self.blocks, w.shape[0] // self.blocks, w.shape[1]) if self.blocks > 1 else None
        self.packed = _pack(w) if pack else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if self.packed is not None and PACKED_MIN_ROWS <= t <= llama.SPLIT_GEMV_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.view is None or t > llama.SPLIT_GEMV_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        return llama.blocked_product(self.view, x, self.bias)                  # W_j x^T, one block per thread


class _Block:
    """One decoder layer as the step's loop runs it: its two norms (weight, eps), ``qkv(h) -> (qk, v)``
    (``(T, H + Hkv, D)`` and ``(T, Hkv, D)``: q and k together, as RoPE rotates them), the output
    projection ``o`` and the feed-forward ``mlp``. How the products are computed is the builder's
    business (:meth:`DecodeStep._block`)."""

    __slots__ = ("norm_in", "eps_in", "norm_post", "eps_post", "qkv", "o", "mlp")

    def __init__(self, layer: llama.DecoderLayer, qkv, o, mlp):
        self.norm_in, self.eps_in = layer.input_layernorm.weight, layer.input_layernorm.eps
        self.norm_post, self.eps_post = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        self.qkv, self.o, self.mlp = qkv, o, mlp


class DecodeStep:
    """``step(tokens, cache) -> logits (T, vocab)``: feed ``T`` tokens after what ``cache`` holds.

    One token is a decode step; a few are a speculative verification pass (module 11), causal
    among themselves. Built from a model that :func:`unsupported` accepts (else ``ValueError``
    with its reason); it reads the model's own weight tensors (views, no copies), so build it again
    after the model's parameters are replaced (``model.to(...)``, ``replace_linears``);
    ``generate_ids`` builds one per generation. ``pack=True`` also copies every weight into
    oneDNN's layout for passes of :data:`PACKED_MIN_ROWS` to 8 tokens (the module's docstring):
    twice the weights' memory, and a copy that does not follow later changes to the weights.

    The cache is an ordinary :class:`KVCache` of batch 1: the step writes each layer's keys and
    values at positions ``cache.length ..`` and then advances every layer, so the module path and
    the step can take turns on one cache.
    """

    def __init__(self, model, *, pack: bool = False):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"model: {why}")
        if not isinstance(pack, bool):
            raise TypeError(f"pack must be True or False, got {pack!r}")
        if pack and packing_unavailable() is not None:
            raise ValueError(f"pack=True: {packing_unavailable()}")
        c = model.config
        self.model = model
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rotary = c.position_embedding == "rope"
        self.pack = pack
        # the step only ever runs without gradients: views (and the split decision) as for inference,
        # also for a model whose weights require grad (one being trained, sampled between epochs)
        with torch.no_grad():
            self.blocks = [self._block(layer) for layer in model.layers]
            self.head = self._head(model.lm_head)
        self.scale = model.layers[0].self_attn.scale
        self.embedding = model.embed_tokens.weight
        self.norm = model.norm

    def _block(self, layer: llama.DecoderLayer) -> _Block:
        """``layer``'s products as the loop calls them: q, k and v each from its own weight (views)."""
        a, m = layer.self_attn, layer.mlp
        q, k, v, o, gate, up, down = (_Projection(p, self.pack) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                                                           m.gate_proj, m.up_proj, m.down_proj))
        h_, hkv, d = self.heads, self.kv_heads, self.head_dim

        def qkv(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            t = h.shape[0]
            return torch.cat([q(h).view(t, h_, d), k(h).view(t, hkv, d)], 1), v(h).view(t, hkv, d)

        return _Block(layer, qkv, o, lambda h: down(F.silu(gate(h)) * up(h)))

    def _head(self, lm_head: llama.Linear):
        """The LM head as the step calls it: ``(T, hidden) -> (T, vocab)`` float32."""
        return _Projection(lm_head, self.pack)

    @staticmethod
    def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos2 = [cos, cos]`` and ``sin2 = [-sin, sin]``, ``(T, 1, head_dim)`` each, from the model's
        ``(T, head_dim/2)`` tables: then ``x * cos2 + rotate_half(x) * sin2`` is ``apply_rope``'s
        ``[x1 cos - x2 sin, x1 sin + x2 cos]``."""
        return torch.cat([cos, cos], -1)[:, None], torch.cat([-sin, sin], -1)[:, None]

    @staticmethod
    def _rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
        """RoPE, ``"half"`` layout, on ``x`` ``(T, heads, D)``: ``x * cos2 + rotate_half(x) * sin2``."""
        half = x.shape[-1] // 2
        return x * cos2 + torch.cat([x[..., half:], x[..., :half]], -1) * sin2

    @torch.inference_mode()
    def __call__(self, tokens: int | list[int], cache: KVCache, *, last: bool = False) -> torch.Tensor:
        """Logits ``(T, vocab)`` of every token fed, or with ``last`` only the last one's ``(1, vocab)``
        (a draft's prefill needs no more; the LM head is a fifth of a step's weights)."""
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        t, pos = len(tokens), cache.length
        if t == 0:
            raise ValueError("tokens is empty")
        if pos + t > cache.max_len:
            raise ValueError(f"the KV cache holds max_len={cache.max_len} positions; cannot add {t} after {pos}")
        h_, hkv, d = self.heads, self.kv_heads, self.head_dim
        group, n = h_ // hkv, pos + t
        hide = None
        if t > 1:  # query i (position pos + i) sees keys 0 .. pos + i: hide the rest, for each query head
            keys_at = torch.arange(n, device=self.embedding.device)
            causal = keys_at[None, :] > (pos + torch.arange(t, device=keys_at.device))[:, None]    # (T, n)
            hide = causal.repeat(group, 1)                                               # (group T, n)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            """Store k, v ``(T, Hkv, D)`` at positions pos.., attend q ``(T, H, D)``; ``(T, H D)``."""
            keys, values = cache.k[i][0], cache.v[i][0]                                 # (Hkv, max_len, D)
            keys[:, pos:n] = k.transpose(0, 1)
            values[:, pos:n] = v.transpose(0, 1)
            # the query heads that share a key/value head are the rows of one product
            q = q.view(t, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * t, d)
            out = grouped_rows_attention(q, keys[:, :n], values[:, :n], self.scale, hide)   # (Hkv, group T, D)
            if t > 1:
                out = out.view(hkv, group, t, d).permute(2, 0, 1, 3)                    # (T, Hkv, group, D)
            return out.reshape(t, h_ * d)

        x = self.embedding[tokens[0]].view(1, -1) if t == 1 else self.embedding[tokens]   # (T, hidden)
        x = self._layers(x, self._rope_tables(*self.model.rope_tables(pos, t)) if self.rotary else None, attend)
        cache.advance(n)
        if last:
            x = x[-1:]
        return self.head(F.rms_norm(x, (x.shape[1],), self.norm.weight, self.norm.eps))

    @torch.inference_mode()
    def packed(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, logits_at: torch.Tensor) -> torch.Tensor:
        """The serving engine's pass (module 16): ``input_ids`` and ``positions`` ``(N,)``, the new
        tokens of several sequences packed in one row; ``batch`` the paged batch that stores their
        keys and values and attends (``llmu.paged.PagedBatch``); logits ``(K, vocab)`` of the rows
        ``logits_at``. The model's ``forward(input_ids[None], positions=, cache=batch, logits_at=)``."""
        n = input_ids.shape[0]
        h_, d = self.heads, self.head_dim

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # the batch takes (1, heads, N, D), as Attention hands it over
            out = batch.attend(i, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                               scale=self.scale)                                        # (1, H, N, D)
            return out[0].transpose(0, 1).reshape(n, h_ * d)

        rope = self._rope_tables(*self.model._rope_at(positions)) if self.rotary else None     # at each position
        x = self._layers(self.embedding[input_ids], rope, attend)
        x = x[logits_at]
        return self.head(F.rms_norm(x, (x.shape[1],), self.norm.weight, self.norm.eps))

    def _layers(self, x: torch.Tensor, rope, attend) -> torch.Tensor:
        """Every block on ``x`` ``(T, hidden)``; ``rope``: ``(cos2, sin2)`` ``(T, 1, D)`` or None;
        ``attend(layer, q, k, v)`` stores k, v and returns the attention output ``(T, H D)``."""
        hidden, h_ = x.shape[1], self.heads
        for i, b in enumerate(self.blocks):
            # -- attention: norm, project, rotate q and k together, store k and v, attend
            qk, v = b.qkv(F.rms_norm(x, (hidden,), b.norm_in, b.eps_in))              # (T, H + Hkv, D), (T, Hkv, D)
            if rope is not None:
                qk = self._rotate(qk, *rope)
            x = x + b.o(attend(i, qk[:, :h_], qk[:, h_:], v))
            # -- the SwiGLU feed-forward
            x = x + b.mlp(F.rms_norm(x, (hidden,), b.norm_post, b.eps_post))
        return x
