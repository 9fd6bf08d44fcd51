"""More launch cases for :mod:`llmu.gpu_compile` (modules 04 with 05's GEMM, 10-13 and the GGUF loader), in the
style of :mod:`llmu.gpu_compile.cases`, to be merged into it.

Each comment says which branch of the launcher the inputs reach on a GPU (compile-only mode picks
the GPU configuration: ``runtime.interpreting()`` is False). Values never matter except where the
host reads them (offsets, expert ids, token ids, lengths): those are built the way the course
builds them, by the modules' own helpers.
"""

from __future__ import annotations

import torch

from llmu.gpu_compile.cases import BF16, F16, F32, Case, backward, rand  # noqa: F401 (all, for the merge)

__all__ = ["_moe", "_quant", "_mamba", "_training", "_spec", "_models"]

I64, I32 = torch.int64, torch.int32


def _grad(*tensors):
    """Leaves that require grad (detached copies)."""
    return [t.detach().requires_grad_(True) for t in tensors]


# ---------------------------------------------------------------------------------------------
# 12 mixture of experts
# ---------------------------------------------------------------------------------------------

def _moe() -> list[Case]:
    from llmu.moe import kernels as k

    def gather(dt, idx_dtype):
        # H = 200: two BLOCK_H = 128 column tiles (the second ragged); 21 rows: two BLOCK_ROWS tiles
        src = torch.tensor([i * 7 % 10 for i in range(21)], dtype=idx_dtype)
        return k.gather_rows(rand(10, 200, dtype=dt), src)

    def experts_of(t, top_k, num_experts, drop=()):
        """(T, k) expert ids with distinct experts per token, -1 where an assignment is dropped."""
        ids = torch.tensor([[(i + j * 3) % num_experts for j in range(top_k)] for i in range(t)], dtype=I64)
        for i, j in drop:
            ids[i, j] = -1
        return ids

    def permute_unpermute(dt):
        # permute (gather kernel) -> unpermute (combine kernel), then backward: unpermute's backward
        # is the gather kernel on d_out, permute's is the combine kernel with float32 weights of 1.
        # Two dropped assignments (-1): they get no row. 37 tokens: three BLOCK_ROWS tiles.
        t, top_k, e = 37, 2, 4
        x, w = _grad(rand(t, 200, dtype=dt), rand(t, top_k, dtype=dt, seed=1).softmax(-1))
        x_sorted, order, _, _ = k.permute(x, experts_of(t, top_k, e, drop=((3, 1), (20, 0))), e)
        out = k.unpermute(x_sorted, order, w, t)
        out.backward(torch.ones_like(out))

    def offsets_of(*counts):
        off = torch.zeros(len(counts) + 1, dtype=I64)
        off[1:] = torch.tensor(counts).cumsum(0)
        return off

    def grouped(dt):
        # E = 4 ragged groups (one empty, one spanning two BLOCK_M = 64 tiles, one of 3 rows), N = 100
        # (a ragged BLOCK_N tile), K = 80 (a ragged BLOCK_K step). Backward: dX = the same kernel on
        # w's transposed view (other strides), dW = _grouped_gemm_dw_kernel.
        off = offsets_of(5, 0, 70, 3)
        x, w = _grad(rand(78, 80, dtype=dt), rand(4, 100, 80, dtype=dt, seed=1))
        out = k.grouped_gemm(x, w, off)
        out.backward(torch.ones_like(out))

    def grouped_dw(dt):
        # the weight-gradient launcher on its own, int32 offsets, a group that needs two BLOCK_M steps
        off = offsets_of(70, 0, 9).to(I32)
        return k.grouped_gemm_dw(rand(79, 48, dtype=dt), rand(79, 72, dtype=dt, seed=1), off, 3)

    def layer(dt, **kw):
        # the whole layer, forward and backward: route (torch) -> permute -> 3 grouped GEMMs + SwiGLU
        # (module 03's kernel) -> unpermute; x (B, T, H) = (2, 12, 64), E = 4, F = 96, k = 2
        x, wg, wu, wd = _grad(rand(2, 12, 64, dtype=dt), rand(4, 96, 64, dtype=dt, seed=2),
                              rand(4, 96, 64, dtype=dt, seed=3), rand(4, 64, 96, dtype=dt, seed=4))
        router = rand(4, 64, seed=1).requires_grad_(True)
        y, aux = k.moe_triton(x, router, wg, wu, wd, 2, **kw)
        (y.float().sum() + aux.lb_loss + aux.z_loss).backward()

    return [
        Case("moe.gather_rows", lambda dt: gather(dt, I64)),
        Case("moe.gather_rows int32 ids", lambda dt: gather(dt, I32)),
        Case("moe.permute + unpermute (combine) backward", permute_unpermute),
        Case("moe.grouped_gemm backward", grouped),
        Case("moe.grouped_gemm_dw", grouped_dw),
        Case("moe.moe_triton backward", layer),
        Case("moe.moe_triton capacity (drops)", lambda dt: layer(dt, capacity_factor=1.0)),
    ]


# ---------------------------------------------------------------------------------------------
# 10 quantization
# ---------------------------------------------------------------------------------------------

def _quant() -> list[Case]:
    from llmu.quant import formats, kernels as k

    def int4(dt, m, n, kdim, g, path=None, lead=()):
        # codes, scales and zeros from the module's own quantizer, packed two codes a byte
        qt = formats.quantize(rand(n, kdim, seed=1), 4, group_size=g)
        return k.int4_matmul(rand(*lead, m, kdim, dtype=dt), qt.packed(), qt.scale, qt.zero, g, path=path)

    def int8(dt, m, n, kdim, path=None, column=False):
        qt = formats.quantize(rand(n, kdim, seed=1), 8, symmetric=True, granularity="channel")
        codes, scale = k.int8_codes(qt)
        return k.int8_matmul(rand(m, kdim, dtype=dt), codes, scale[:, None] if column else scale, path=path)

    # GEMV (M <= 4): BLOCK_N = 8, BLOCK_KH = 128 shrunk to the largest of 128/64/32/16 whose 2*BLOCK_KH
    # inputs divide G; GROUP_TILE when such a tile exists. GEMM: M <= 16 -> 16x64x64 (4 warps, 4
    # stages), M <= 64 -> 64x64x64, else 128x128x32 (8 warps, 3 stages); GROUP_TILE when 2*BLOCK_KH | G.
    return [
        Case("quant.int4 gemv G=256 (BLOCK_KH 128, group tile)", lambda dt: int4(dt, 1, 40, 512, 256)),
        Case("quant.int4 gemv G=128 (BLOCK_KH 64, group tile)", lambda dt: int4(dt, 1, 40, 512, 128)),
        Case("quant.int4 gemv G=32 (BLOCK_KH 16, group tile)", lambda dt: int4(dt, 4, 40, 256, 32)),
        Case("quant.int4 gemv G=24 (BLOCK_KH 128, per-byte groups)", lambda dt: int4(dt, 3, 40, 96, 24, lead=(1,))),
        Case("quant.int4 gemv forced at M=20", lambda dt: int4(dt, 20, 40, 256, 64, path="gemv")),
        Case("quant.int4 gemm M=8 (16x64x64) G=128 group tile", lambda dt: int4(dt, 8, 72, 256, 128)),
        Case("quant.int4 gemm M=2 forced (16x64x64) G=32 per-byte", lambda dt: int4(dt, 2, 72, 256, 32, path="gemm")),
        Case("quant.int4 gemm M=40 (64x64x64) G=128 group tile", lambda dt: int4(dt, 40, 72, 256, 128)),
        Case("quant.int4 gemm M=40 (64x64x64) G=64 per-byte", lambda dt: int4(dt, 40, 72, 256, 64)),
        Case("quant.int4 gemm M=100 (128x128x32) G=64 group tile", lambda dt: int4(dt, 100, 150, 256, 64)),
        Case("quant.int4 gemm M=100 (128x128x32) G=32 per-byte", lambda dt: int4(dt, 100, 150, 256, 32)),
        Case("quant.int8 gemv (BLOCK_K 256, ragged K)", lambda dt: int8(dt, 1, 40, 300)),
        Case("quant.int8 gemv forced at M=20, (N, 1) scale", lambda dt: int8(dt, 20, 40, 300, "gemv", True)),
        Case("quant.int8 gemm M=8 (16x64x128)", lambda dt: int8(dt, 8, 72, 300)),
        Case("quant.int8 gemm M=2 forced", lambda dt: int8(dt, 2, 72, 300, "gemm")),
        Case("quant.int8 gemm M=40 (64x64x128)", lambda dt: int8(dt, 40, 72, 300)),
        Case("quant.int8 gemm M=100 (128x128x64)", lambda dt: int8(dt, 100, 150, 300)),
    ]


# ---------------------------------------------------------------------------------------------
# 13 mamba
# ---------------------------------------------------------------------------------------------

def _mamba() -> list[Case]:
    from llmu.mamba import kernels as k

    def scan(dt, batch=2, dim=6, L=10, N=16, bc="shared", D=False, z=False, bias=False, softplus=False,
             last=False, grad=False, **tiles):
        u, delta = rand(batch, dim, L, dtype=dt), rand(batch, dim, L, dtype=dt, seed=1)
        A = -torch.rand(dim, N)                                    # float32, as Mamba keeps A
        shapes = {"shared": (batch, N, L), "constant": (dim, N), "grouped": (batch, 2, N, L)}[bc]
        B, C = rand(*shapes, dtype=dt, seed=2), rand(*shapes, dtype=dt, seed=3)
        Dv = torch.ones(dim) if D else None
        zv = rand(batch, dim, L, dtype=dt, seed=4) if z else None
        bv = torch.zeros(dim, dtype=dt) if bias else None
        if grad:
            # every input requires grad: the forward also stores its checkpoints, then the backward kernel
            u, delta, A, B, C = _grad(u, delta, A, B, C)
            Dv, zv, bv = (t if t is None else t.detach().requires_grad_(True) for t in (Dv, zv, bv))
        with torch.set_grad_enabled(grad):
            result = k.selective_scan_triton(u, delta, A, B, C, D=Dv, z=zv, delta_bias=bv, delta_softplus=softplus,
                                             return_last_state=last, **tiles)
        if grad:
            out, state = result if last else (result, None)
            loss = out.float().sum() + (state.sum() if last else 0)   # with the last state: HAS_DLAST
            loss.backward()
        return result

    return [
        # every switch off; L = 10: one chunk of 16, BLOCK_D = 8 (N = 16)
        Case("mamba.scan plain", lambda dt: scan(dt)),
        # every switch on (HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, STORE_LAST); time-invariant B/C (D, N);
        # L = 200: four chunks of 64 (the last ragged), BLOCK_D = 2
        Case("mamba.scan D z bias softplus last, chunked", lambda dt: scan(dt, L=200, bc="constant", D=True, z=True,
                                                                          bias=True, softplus=True, last=True)),
        # mixed switches; grouped B/C (B, G, N, L); N = 10 padded to 16; chunked
        Case("mamba.scan D softplus, grouped B/C, N=10", lambda dt: scan(dt, L=100, N=10, bc="grouped", D=True,
                                                                        softplus=True)),
        Case("mamba.scan z bias last", lambda dt: scan(dt, L=40, z=True, bias=True, last=True)),
        # explicit tiles (chunk 32, block_d 4), Mamba-like N = 16, D = 64
        Case("mamba.scan explicit tiles", lambda dt: scan(dt, dim=64, L=70, D=True, z=True, softplus=True,
                                                         chunk=32, block_d=4)),
        # forward with checkpoints + backward kernel. Mamba's call: D, z, bias, softplus, B/C shared
        # (B, N, L), added up with atomics; L = 100: two chunks of 64, the last ragged
        Case("mamba.scan backward: D z bias softplus, shared B/C", lambda dt: scan(dt, L=100, D=True, z=True,
                                                                                  bias=True, softplus=True,
                                                                                  grad=True)),
        # time-invariant B/C (B_CONST, C_CONST: summed in registers) and the last state's gradient
        # (HAS_DLAST); no D, z, bias; softplus
        Case("mamba.scan backward: time-invariant B/C, last state", lambda dt: scan(dt, L=70, bc="constant",
                                                                                   softplus=True, last=True,
                                                                                   grad=True)),
        # grouped B/C (B, G, N, L), N = 10 padded to 16, z and bias without softplus
        Case("mamba.scan backward: grouped B/C, N=10", lambda dt: scan(dt, L=40, N=10, bc="grouped", z=True,
                                                                      bias=True, grad=True)),
    ]


# ---------------------------------------------------------------------------------------------
# 04 training
# ---------------------------------------------------------------------------------------------

def _training() -> list[Case]:
    from llmu.training import kernels as k

    def flce(dt, grad_x=True, grad_w=True, target_dtype=I64, ignore_index=-100, **kw):
        # N = 50 rows (H = 96, V = 300): default row_chunk 16, so four backward chunks, the last of
        # 2 rows; targets include ignore_index. A frozen weight skips the dW matmul (need_dw False),
        # a frozen x the dx one (need_dx False).
        x = rand(5, 10, 96, dtype=dt).requires_grad_(grad_x)
        w = (rand(300, 96, dtype=dt, seed=1) * 0.1).requires_grad_(grad_w)
        target = (torch.arange(50) * 7 % 300).reshape(5, 10)
        target[0, 3] = target[4, 9] = ignore_index
        loss = k.fused_linear_cross_entropy(x, w, target.to(target_dtype), ignore_index=ignore_index, **kw)
        if grad_x or grad_w:
            loss.backward()
        return loss

    def matmul(dt, accumulate):
        # dx-like: out in the inputs' dtype, overwritten; dW-like: a float32 accumulator += a
        # transposed view @ b (strides read as given)
        a, b = rand(70, 90, dtype=dt), rand(90, 40, dtype=dt, seed=1)
        if accumulate:
            return k.matmul(a.T, rand(70, 40, dtype=dt, seed=2), torch.zeros(90, 40), accumulate=True)
        return k.matmul(a, b, torch.empty(70, 40, dtype=dt))

    def tuned_matmul(dt):
        # Module 05's GEMM (llmu.roofline.kernels), listed here beside module 04's matmul. Its launcher
        # picks the tiles for the target (sm_90/sm_80: 128 x 256 x 64, 3 stages, 8 warps for 16-bit;
        # sm_75: 64 x 64 x 16, 2 stages; float32: 64 x 64 x 32). M = 300, N = 176, K = 1040 are
        # ragged against every tile (K ends in a masked step) and, as a model's widths are,
        # multiples of 16, which keeps rows 16-byte aligned and the loads vectorized (odd widths
        # compile to scalar loads that spill registers). First x @ W^T (W^T a transposed view, K
        # contiguous), then a row-major b (N contiguous) into a float32 out.
        from llmu.roofline import kernels as r

        x, w = rand(300, 1040, dtype=dt), rand(176, 1040, dtype=dt, seed=1)
        r.matmul(x, w.t())
        return r.matmul(x, w.t().contiguous(), out=torch.empty(300, 176))

    return [
        Case("roofline.matmul (05) ragged M, N, K; W^T view and row-major B", tuned_matmul),
        Case("training.flce forward+backward (dx, dW), ignore_index", flce),
        Case("training.flce label smoothing 0.1, sum, frozen weight (no dW)",
             lambda dt: flce(dt, grad_w=False, label_smoothing=0.1, reduction="sum")),
        Case("training.flce frozen x (no dx), int32 targets, ignore_index=-1",
             lambda dt: flce(dt, grad_x=False, target_dtype=I32, ignore_index=-1, label_smoothing=0.2)),
        Case("training.flce forward only", lambda dt: flce(dt, grad_x=False, grad_w=False)),
        Case("training.matmul accumulate=False", lambda dt: matmul(dt, False)),
        Case("training.matmul accumulate=True", lambda dt: matmul(dt, True)),
    ]


# ---------------------------------------------------------------------------------------------
# 11 speculative decoding
# ---------------------------------------------------------------------------------------------

def _spec() -> list[Case]:
    from llmu.spec import kernels as k

    def probs(dt, b, gamma, v, draft_dtype=I64):
        p = rand(b, gamma + 1, v, dtype=F32).softmax(-1).to(dt)
        q = rand(b, gamma, v, dtype=F32, seed=1).softmax(-1).to(dt)
        draft = (torch.arange(b * gamma).reshape(b, gamma) * 37 % v).to(draft_dtype)   # ids in [0, V)
        return p, q, draft

    def accept(dt, v, draft_dtype=I64, **kw):
        p, q, draft = probs(dt, 3, 4, v, draft_dtype)
        g = torch.Generator().manual_seed(0)
        return k.accept_reject(p, q, draft, torch.rand(3, 4, generator=g), torch.rand(3, generator=g), **kw)

    def sample(dt, v):
        p, q, draft = probs(dt, 2, 3, v)
        return k.speculative_sample(p, q, draft, generator=torch.Generator().manual_seed(0))

    def ragged(dt, v, lens=None, bonus=None, gamma=4, **kw):
        # a ragged batch (draft_lens: one sequence with no proposal, one with all γ) and/or the
        # engine's own bonus tokens: the HAS_LENS / HAS_BONUS specialisations of the kernel
        p, q, draft = probs(dt, 3, gamma, v)
        g = torch.Generator().manual_seed(0)
        u, r = torch.rand(3, gamma, generator=g), torch.rand(3, generator=g)
        return k.accept_reject(p, q, draft, u, r, draft_lens=lens, bonus_token=bonus, **kw)

    return [
        # V = 100: BLOCK_V = 128, 4 warps, one tile
        Case("spec.accept_reject V=100 (BLOCK_V 128, 4 warps)", lambda dt: accept(dt, 100)),
        # V = 5000: BLOCK_V = 4096 = MAX_BLOCK_V, 8 warps, two tiles (the second ragged); int32 ids
        Case("spec.accept_reject V=5000 (BLOCK_V 4096, 8 warps)", lambda dt: accept(dt, 5000, I32)),
        # block_v given: 16-wide tiles, several of them
        Case("spec.accept_reject block_v=16", lambda dt: accept(dt, 100, block_v=16)),
        Case("spec.accept_reject ragged draft_lens (int64), V=100",
             lambda dt: ragged(dt, 100, lens=torch.tensor([0, 4, 2]))),
        Case("spec.accept_reject bonus_token (int32), V=5000",
             lambda dt: ragged(dt, 5000, bonus=torch.tensor([1, 2, 3], dtype=I32))),
        Case("spec.accept_reject draft_lens (int32) + bonus_token (int64), block_v=16",
             lambda dt: ragged(dt, 100, lens=torch.tensor([3, 0, 4], dtype=I32), bonus=torch.tensor([7, 8, 9]),
                               block_v=16)),
        Case("spec.accept_reject no proposals (gamma 0, draft_lens zeros)",
             lambda dt: ragged(dt, 100, lens=torch.zeros(3, dtype=I64), gamma=0)),
        Case("spec.speculative_sample V=300", lambda dt: sample(dt, 300)),
        Case("spec.speculative_sample V=49152 (SmolLM2)", lambda dt: sample(dt, 49152)),
    ]


# ---------------------------------------------------------------------------------------------
# GGUF dequantization (llmu.models)
# ---------------------------------------------------------------------------------------------

def _models() -> list[Case]:
    from llmu.models import kernels as k, quants

    # dequantize_blocks takes raw uint8 bytes only and always returns float32: no float input, so
    # each case runs once (dtypes=(F32,); the dtype is not used). 100 blocks: two programs of the
    # 64 blocks a GPU program takes (the second ragged). Bytes from the module's own quantizers.
    return [
        Case("models.dequantize_blocks Q8_0",
             lambda dt: k.dequantize_blocks(quants.quantize_q8_0(rand(100 * 32)).reshape(-1), quants.Q8_0),
             dtypes=(F32,)),
        Case("models.dequantize_blocks Q4_1 (rows, bytes)",
             lambda dt: k.dequantize_blocks(quants.quantize_q4_1(rand(10, 320)).reshape(10, -1), quants.Q4_1),
             dtypes=(F32,)),
    ]

