"""The target's own decode step with its weights read at 4 bits: what :class:`~llmu.spec.drafts.QuantizedDraft` runs.

A decode step of SmolLM2 in float32 reads 538 MB of weights, and on a CPU that reading *is* the
step (module 05). The same model with its block weights in 4-bit codes (module 10) reads under a
fifth of that, and predicts nearly the same next tokens: the rounding moves the logits a little,
and the argmax rarely. That makes it a draft, with no second model to train or ship (QSpec, 2024,
drafts the same way with 4-bit activations and verifies with 16-bit ones): it proposes ``gamma``
tokens, the float32 target checks them in one pass, and the output is the target's, token for
token (:class:`~llmu.spec.drafts.QuantizedDraft` holds a :class:`QuantizedStep` and its own KV cache).

What it reads, per token, for SmolLM2-135M (:attr:`QuantizedStep.weight_bytes`):

==================================  ===================================  ==========
weights                             format                               MB
==================================  ===================================  ==========
30 blocks' 7 projections (106 M)    4-bit codes, a bf16 scale and        66
                                    minimum per 32 inputs (5 bits each)
LM head, tied to the embedding      8-bit codes, a bf16 scale per row    28
(49,152 x 576)
==================================  ===================================  ==========

against 538 MB in float32. The head keeps 8 bits: it decides the argmax directly, and the
course's file stores it at 8 bits (GGUF Q8_0), so 4 bits there would be a real loss (agreement
with the target fell from 0.98 to 0.90 on the three prompts of :mod:`llmu.spec.prompts`). The
blocks are rounded with :func:`~llmu.quant.formats.quantize_minmax`, each group onto its own
range; module 10's integer zero point, whose range must contain 0, agreed only 0.83 of the time.
The file stores the blocks in Q4_1 (the same min-max rounding, groups of 32), so here that
rounding finds the file's own codes again: the draft's block weights are the target's up to the
bf16 rounding of each scale and minimum.

The products run on PyTorch's own CPU kernels for weight-only quantization, the ones gpt-fast and
torchao use: ``aten._weight_int4pack_mm_for_cpu`` (codes repacked once by
``aten._convert_weight_to_int4pack_for_cpu``) and ``aten._weight_int8pack_mm``. They take
bfloat16 activations (for float32 they fall back to a scalar loop, 30 times slower), so the draft
converts each norm's output to bf16 before a product and the product's output back to float32;
the residual stream, the norms, RoPE, the KV cache and the attention stay float32. q, k and v
are one fused product, and so are the gate and up projections: four products a layer instead of
seven (each call costs a few microseconds of dispatch whatever its size).

The loop is :class:`~llmu.models.decode_step.DecodeStep`'s, with other products
(:class:`QuantizedStep` overrides how a block and the head are built). On the course's 2-core
machine a draft token took 12 ms against 19 ms for a float32 step (0.6 of it, for 0.18 of the
bytes): the int4 kernel reads its codes at about 10 GB/s where the float32 products stream 30, and
some 4 ms of a step is PyTorch's dispatch of about 1,400 small operations, which no format
shrinks. The draft agreed with the target's greedy token at 0.97-0.99 of the positions of the
three prompts; ``llmu bench spec_decode`` measures what that buys (about nothing on that machine,
module 11's notebook says why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.models import llama
from llmu.models.decode_step import DecodeStep, _Block
from llmu.quant.formats import QuantizedTensor, quantize, quantize_minmax

__all__ = ["QuantizedStep", "Int4Product", "Int8Product", "quantized_unavailable", "GROUP_SIZES"]

#: Group sizes the CPU int4 kernel takes (inputs sharing one scale and zero).
GROUP_SIZES = (32, 64, 128, 256)

_INT4_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm")


def quantized_unavailable() -> str | None:
    """Why this PyTorch cannot run :class:`QuantizedStep`, or ``None`` when it can (it needs the
    CPU kernels for int4 and int8 weight-only products, PyTorch 2.6 and later)."""
    missing = [name for name in _INT4_OPS if getattr(torch.ops.aten, name, None) is None]
    if missing:
        return f"this PyTorch lacks torch.ops.aten.{', '.join(missing)} (PyTorch >= 2.6 has them)"
    return None


class Int4Product:
    """``x W^T`` for bf16 rows ``x`` ``(T, K)``, ``W`` ``(N, K)`` held as 4-bit codes with a scale
    and a zero per group of ``group_size`` inputs: the weights of ``qt`` (asymmetric, 4 bits,
    any :class:`~llmu.quant.formats.QuantizedTensor` of module 10, GGUF Q4_1 included).

    The kernel computes ``w = (q - 8) * scale + zero'`` with bf16 ``scale`` and ``zero'``: module 10's
    ``w = (q - z) * s`` is that with ``zero' = (8 - z) * s`` (Q4_1's ``w = q d + m``: ``zero' = m + 8 d``).
    Rounding ``scale`` and ``zero'`` to bf16 (8 significant bits, a unit roundoff of ``2^-8``) moves
    a weight by at most ``2^-8 (8 |scale| + |zero'|)``.
    """

    __slots__ = ("packed", "scales_zeros", "group_size", "out_features")

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: the packed codes and the bf16 scales and zeros."""
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2

    def __init__(self, qt: QuantizedTensor):
        if not isinstance(qt, QuantizedTensor):
            raise TypeError(f"qt must be a llmu.quant.formats.QuantizedTensor, got {type(qt).__name__}")
        qt.validate("qt")
        if qt.bits != 4 or qt.granularity != "group" or qt.group_size not in GROUP_SIZES:
            raise ValueError(f"qt must be 4-bit with groups of {GROUP_SIZES} inputs, got {qt.bits} bits, "
                             f"{qt.granularity!r} granularity, group_size {qt.group_size}")
        n, k = qt.shape
        if n % 16:
            raise ValueError(f"qt has {n} output rows; the CPU int4 kernel packs them 16 at a time (a multiple of 16)")
        s = qt.scale
        zero = qt.offset + 8 * s if qt.offset is not None else (8 - qt.zero) * s           # (N, K / G)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qt.codes.to(torch.int32), 1)
        self.scales_zeros = torch.stack([s.t(), zero.t()], -1).to(torch.bfloat16).contiguous()  # (K / G, N, 2)
        self.group_size = qt.group_size
        self.out_features = qt.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros)


class Int8Product:
    """``x W^T`` for bf16 rows ``x``, ``W`` ``(N, K)`` held as int8 codes with one bf16 scale per row
    (symmetric, per channel: ``w = q * s``), quantized here from the float ``w``."""

    __slots__ = ("codes", "scale")

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: the int8 codes and the bf16 scales."""
        return self.codes.numel() + self.scale.numel() * 2

    def __init__(self, w: torch.Tensor):
        if not isinstance(w, torch.Tensor) or w.ndim != 2:
            raise TypeError(f"w must be a 2-D tensor (out_features, in_features), got {getattr(w, 'shape', type(w))}")
        if w.shape[1] % 16:  # the kernel reads 16 inputs at a time and runs past the end otherwise
            raise ValueError(f"w has {w.shape[1]} inputs; the CPU int8 kernel needs a multiple of 16")
        qt = quantize(w, 8, symmetric=True, granularity="channel")
        self.codes = (qt.codes.to(torch.int16) - 128).to(torch.int8).contiguous()          # q - z, z = 128
        self.scale = qt.scale[:, 0].to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scale)


class QuantizedStep(DecodeStep):
    """:class:`~llmu.models.decode_step.DecodeStep` with the block weights at 4 bits (groups of
    ``group_size``) and the LM head at 8: ``step(tokens, cache) -> logits (T, vocab)`` float32,
    close to the model's, not equal (the module's docstring). The codes are computed once, here,
    from the model's float32 weights (:func:`~llmu.quant.formats.quantize_minmax` for the blocks,
    symmetric per-row :func:`~llmu.quant.formats.quantize` for the head); the products hold only
    the codes, so later changes to the weights do not reach them.
    """

    def __init__(self, model, *, group_size: int = 32):
        why = quantized_unavailable()
        if why is not None:
            raise ValueError(why)
        if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        k = {model.config.hidden_size, model.config.intermediate_size} if hasattr(model, "config") else set()
        if any(n % group_size for n in k):
            raise ValueError(f"group_size {group_size} must divide the projections' inputs {sorted(k)}")
        self.group_size = group_size
        self.products: list[Int4Product | Int8Product] = []
        super().__init__(model)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a step reads (every product once): what sets its speed on a CPU."""
        return sum(p.nbytes for p in self.products)

    def _int4(self, *linears: llama.Linear) -> Int4Product:
        """The weights of ``linears`` stacked (their outputs side by side) as one 4-bit product."""
        w = torch.cat([lin.weight for lin in linears]) if len(linears) > 1 else linears[0].weight
        product = Int4Product(quantize_minmax(w, 4, group_size=self.group_size))
        self.products.append(product)
        return product

    def _block(self, layer: llama.DecoderLayer) -> _Block:
        a, m = layer.self_attn, layer.mlp
        if any(p.bias is not None for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                             m.down_proj)):
            raise ValueError("model: a projection has a bias; QuantizedStep quantizes bias-free projections only")
        qkv_w, o_w, gate_up, down = (self._int4(a.q_proj, a.k_proj, a.v_proj), self._int4(a.o_proj),
                                     self._int4(m.gate_proj, m.up_proj), self._int4(m.down_proj))
        h_, hkv, d, inner = self.heads, self.kv_heads, self.head_dim, m.gate_proj.out_features

        def qkv(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = qkv_w(h.to(torch.bfloat16)).float()                                       # (T, (H + 2 Hkv) D)
            qk, v = y.split([(h_ + hkv) * d, hkv * d], 1)
            t = h.shape[0]
            return qk.view(t, h_ + hkv, d), v.view(t, hkv, d)

        def o(x: torch.Tensor) -> torch.Tensor:
            return o_w(x.to(torch.bfloat16)).float()

        def mlp(h: torch.Tensor) -> torch.Tensor:
            g, u = gate_up(h.to(torch.bfloat16)).split(inner, 1)
            return down(F.silu(g) * u).float()

        return _Block(layer, qkv, o, mlp)

    def _head(self, lm_head: llama.Linear):
        if lm_head.bias is not None:
            raise ValueError("model: the LM head has a bias; QuantizedStep quantizes a bias-free head only")
        head = Int8Product(lm_head.weight)
        self.products.append(head)
        return lambda x: head(x.to(torch.bfloat16)).float()
