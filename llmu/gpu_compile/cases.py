"""The launches :mod:`llmu.gpu_compile` makes: every kernel launcher of llmu, called the way the
course calls it, once per dtype.

A case names the *inputs* only (shapes that reach each branch of a launcher: a row that fits one
block and one that does not, causal and not, decode and prefill). The *configuration* each launch
compiles with (tile sizes, warps, stages, constexpr switches) is whatever the launcher's own code
picks on a GPU, so this list cannot drift from what a GPU runs. The check fails when a kernel of
llmu is reached by no case, and when a case leaves out a dtype its launcher accepts.

Inputs are CPU tensors (compile-only mode launches nothing, so their values never matter except
where the host reads them, e.g. lengths and block tables, which are set up to be valid).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmu.checks import FLOAT_DTYPES

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@dataclass(frozen=True)
class Case:
    """``run(dtype)`` calls one launcher (or one autograd function, forward and backward) with
    inputs of ``dtype``; ``dtypes`` are those it is compiled for."""

    name: str
    run: Callable[[torch.dtype], object]
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES


def rand(*shape, dtype=F32, seed: int = 0) -> torch.Tensor:
    """Standard-normal CPU values of ``dtype`` (drawn in float32 so every dtype sees the same numbers)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cpu").to(dtype)


def backward(fn, *inputs, **kwargs):
    """Run ``fn(*inputs)`` forward and its backward (every input gets a gradient)."""
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    out = fn(*leaves, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))


# ---------------------------------------------------------------------------------------------
# 00 welcome, 01 embeddings, 02 attention
# ---------------------------------------------------------------------------------------------

def _welcome() -> list[Case]:
    from llmu.welcome import kernels as k

    return [
        Case("welcome.add", lambda dt: k.add(rand(5000, dtype=dt), rand(5000, dtype=dt, seed=1))),
        Case("welcome.softmax one block", lambda dt: k.softmax(rand(8, 1000, dtype=dt))),
        Case("welcome.softmax looped", lambda dt: k.softmax(rand(8, 3 * k.MAX_SOFTMAX_BLOCK + 5, dtype=dt))),
    ]


def _embeddings() -> list[Case]:
    from llmu.embeddings import kernels as k

    return [
        Case("embeddings.cosine_similarity", lambda dt: k.cosine_similarity(rand(8, 576, dtype=dt),
                                                                           rand(1000, 576, dtype=dt))),
        Case("embeddings.cosine_similarity ragged D", lambda dt: k.cosine_similarity(rand(3, 100, dtype=dt),
                                                                                    rand(70, 100, dtype=dt))),
    ]


def _attention() -> list[Case]:
    from llmu.attention import kernels as k

    def attn(dt, tq, tk, **kw):
        return k.attention(rand(2, 9, tq, 64, dtype=dt), rand(2, 3, tk, 64, dtype=dt, seed=1),
                           rand(2, 3, tk, 64, dtype=dt, seed=2), **kw)

    return [
        Case("attention.softmax one block", lambda dt: k.softmax(rand(4, 6, 300, dtype=dt), temperature=0.7)),
        Case("attention.softmax looped", lambda dt: k.softmax(rand(4, k.SOFTMAX_ONE_BLOCK_MAX + 1, dtype=dt))),
        Case("attention.softmax backward", lambda dt: backward(k.softmax, rand(4, 300, dtype=dt))),
        Case("attention.attention prefill", lambda dt: attn(dt, 100, 100)),
        Case("attention.attention causal + weights", lambda dt: attn(dt, 100, 100, causal=True, return_weights=True)),
        Case("attention.attention decode", lambda dt: attn(dt, 1, 77, causal=True)),
        Case("attention.attention head_dim 96", lambda dt: k.attention(rand(1, 2, 40, 96, dtype=dt),
                                                                      rand(1, 2, 40, 96, dtype=dt),
                                                                      rand(1, 2, 40, 96, dtype=dt))),
    ]


# ---------------------------------------------------------------------------------------------
# 03 RoPE, SwiGLU, RMSNorm
# ---------------------------------------------------------------------------------------------

def _layers() -> list[Case]:
    from llmu.layers import reference, rmsnorm, rope, swiglu

    def rotate(dt, heads, layout="half", per_sequence=False):
        cos, sin = reference.rope_angles(torch.arange(24, device="cpu"), 64)
        if per_sequence:
            cos, sin = cos.expand(2, -1, -1).contiguous(), sin.expand(2, -1, -1).contiguous()
        q, k = rand(2, heads, 24, 64, dtype=dt), rand(2, 3, 24, 64, dtype=dt, seed=1)
        rope.rope(q, k, cos.to(dt), sin.to(dt), layout=layout)
        backward(lambda x: rope.RoPEFunction.apply(x.clone(), cos.to(dt), sin.to(dt), layout), q)

    return [
        Case("layers.rms_norm SmolLM2 width", lambda dt: backward(rmsnorm.rms_norm, rand(3, 7, 576, dtype=dt),
                                                                 rand(576, dtype=dt, seed=1))),
        Case("layers.rms_norm wide rows", lambda dt: backward(rmsnorm.rms_norm, rand(5, 8192, dtype=dt),
                                                             rand(8192, dtype=dt, seed=1))),
        Case("layers.rope half layout", lambda dt: rotate(dt, 9)),
        Case("layers.rope interleaved, per-sequence angles", lambda dt: rotate(dt, 9, "interleaved", True)),
        Case("layers.rope many heads", lambda dt: rotate(dt, 128)),
        Case("layers.swiglu", lambda dt: backward(swiglu.swiglu_fused, rand(3, 7, 1536, dtype=dt),
                                                  rand(3, 7, 1536, dtype=dt, seed=1))),
    ]


# ---------------------------------------------------------------------------------------------
# 06 KV cache, 07 GQA, 08 FlashAttention, 09 PagedAttention
# ---------------------------------------------------------------------------------------------

def _decode_inputs(dt, b=3, h=9, hkv=3, max_len=300, d=64):
    lengths = torch.tensor([1, 150, max_len][:b], dtype=torch.int64, device="cpu")
    return (rand(b, h, d, dtype=dt), rand(b, hkv, max_len, d, dtype=dt, seed=1),
            rand(b, hkv, max_len, d, dtype=dt, seed=2), lengths)


def _kvcache() -> list[Case]:
    from llmu.gqa import kernels as gqa
    from llmu.kvcache import kernels as k

    return [
        Case("kvcache.decode_attention", lambda dt: k.decode_attention(*_decode_inputs(dt), num_splits=4)),
        Case("kvcache.decode_attention head_dim 128, MHA", lambda dt: k.decode_attention(
            *_decode_inputs(dt, h=4, hkv=4, d=128), num_splits=2)),
        Case("kvcache.decode_attention head_dim 256", lambda dt: k.decode_attention(
            *_decode_inputs(dt, d=256), num_splits=2)),
        Case("kvcache.combine_partials", lambda dt: k.combine_partials(
            rand(2, 9, 4, 64), rand(2, 9, 4), out_dtype=dt, return_lse=True)),
        Case("gqa.gqa_decode ungrouped", lambda dt: gqa.gqa_decode(*_decode_inputs(dt)[:3], grouped=False,
                                                                   num_splits=3)),
        Case("gqa.gqa_decode MQA (32 heads per KV head)", lambda dt: gqa.gqa_decode(
            *_decode_inputs(dt, h=32, hkv=1)[:3], num_splits=1)),
    ]


def _flash() -> list[Case]:
    from llmu.flash import kernels as k

    def run(dt, d, causal, tq=200, tk=200):
        q = rand(2, 6, tq, d, dtype=dt)
        kv = [rand(2, 2, tk, d, dtype=dt, seed=s) for s in (1, 2)]
        backward(k.flash_attention, q, *kv, causal=causal)

    return [Case(f"flash.flash_attention head_dim {d}{' causal' if causal else ''}",
                 (lambda dt, d=d, causal=causal: run(dt, d, causal)))
            for d in k.HEAD_DIMS for causal in (False, True)] + [
        Case("flash.flash_attention decode step", lambda dt: k.flash_attention_forward(
            rand(1, 6, 1, 64, dtype=dt), rand(1, 2, 77, 64, dtype=dt), rand(1, 2, 77, 64, dtype=dt), causal=True)),
    ]


def _paged_inputs(dt, d=64, h=9, hkv=3, block_size=16, lens=(40, 100)):
    """A block pool of 16 blocks and two sequences whose tables point at distinct blocks."""
    per_seq = -(-max(lens) // block_size)
    tables = torch.arange(len(lens) * per_seq, dtype=torch.int32, device="cpu").reshape(len(lens), per_seq)
    num_blocks = len(lens) * per_seq + 2
    k_cache = rand(num_blocks, block_size, hkv, d, dtype=dt, seed=1)
    v_cache = rand(num_blocks, block_size, hkv, d, dtype=dt, seed=2)
    return h, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device="cpu")


def _paged() -> list[Case]:
    from llmu.paged import kernels as k

    def decode(dt, **kw):
        h, kc, vc, tables, lens = _paged_inputs(dt, **kw)
        return k.paged_decode_attention(rand(len(lens), h, kc.shape[-1], dtype=dt), kc, vc, tables, lens,
                                        num_splits=2)

    def prefill(dt, q_lens=(7, 100), **kw):
        h, kc, vc, tables, lens = _paged_inputs(dt, **kw)
        cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device="cpu")
        return k.paged_prefill_attention(rand(sum(q_lens), h, kc.shape[-1], dtype=dt), kc, vc, tables, cu, lens)

    return [
        Case("paged.paged_decode_attention", decode),
        Case("paged.paged_decode_attention block 32, head_dim 128", lambda dt: decode(dt, d=128, block_size=32)),
        Case("paged.paged_decode_attention head_dim 256", lambda dt: decode(dt, d=256)),
        Case("paged.paged_prefill_attention", prefill),
        Case("paged.paged_prefill_attention head_dim 256", lambda dt: prefill(dt, d=256)),
    ]
