"""A tiled matrix product in Triton, with its tiles chosen for the GPU it runs on (module 05).

``matmul(a, b)`` computes ``C = A @ B`` for ``A`` ``(M, K)`` and ``B`` ``(K, N)``. Each program
of the kernel owns one ``BLOCK_M x BLOCK_N`` tile of ``C``: it walks ``K`` in steps of ``BLOCK_K``,
loads a ``BLOCK_M x BLOCK_K`` slice of ``A`` and a ``BLOCK_K x BLOCK_N`` slice of ``B``, multiplies
them on the tensor cores (``tl.dot``) into a float32 accumulator held in registers, and writes the
tile once at the end. Masks keep the ragged last tiles (``M``, ``N`` or ``K`` not a multiple of the
block) inside the matrices.

The napkin math, for ``M = N = K = 4096`` in bf16 (``e = 2`` bytes per element) on an H200
(989.5 TFLOP/s dense bf16, 4.8 TB/s):

* FLOPs: ``2 M N K`` = 137.4 GFLOP, 0.139 ms at the compute roof.
* Bytes, if each operand crossed the memory bus once: ``e (M K + K N + M N)`` = 100.7 MB, 21 us
  at the memory roof. Intensity 1365 FLOP/byte: far right of the ridge (206), compute-bound.
* But a tiled kernel does not read each operand once. Every program reads a whole row panel of
  ``A`` (``BLOCK_M x K``) and a column panel of ``B`` (``K x BLOCK_N``): ``e M N K (1/BLOCK_N +
  1/BLOCK_M)`` bytes over the whole grid. Per step of ``K`` a program loads
  ``e BLOCK_K (BLOCK_M + BLOCK_N)`` bytes and does ``2 BLOCK_M BLOCK_N BLOCK_K`` FLOPs: the
  **intensity of a tile**, ``2 BLOCK_M BLOCK_N / (e (BLOCK_M + BLOCK_N))``, is what the tile size
  buys. A 16 x 16 tile gives 8 FLOP/byte (17.2 GB of loads, 3.6 ms at 4.8 TB/s: memory-bound by
  far); 128 x 256 gives 85.3 FLOP/byte (1.6 GB, 0.34 ms if it all came from memory). Even that is
  left of the ridge: the kernel only reaches the compute roof because most of those loads hit the
  L2 cache (50 MB on an H100), not memory.
* **GROUP_M** decides how often they hit. Programs run roughly in the order of their id. In
  row-major order (all the tiles of one row of ``C``, then the next row) the programs running
  together read every column panel of ``B`` — all of ``B`` — before any of it is used again; the
  grouped order of Triton's matmul tutorial walks ``GROUP_M`` rows of tiles column by column, so
  the programs running together share ``GROUP_M`` panels of ``A`` and a few panels of ``B``, which
  stay in L2 while they are needed.
* **num_stages** is how many ``K`` steps are in flight: while the tensor cores work on step ``k``,
  the loads of steps ``k + 1 .. k + num_stages - 1`` are already on their way to shared memory. Each
  stage holds one slice of ``A`` and one of ``B``: :func:`shared_memory_bytes`. More stages hide
  more memory latency until shared memory runs out (227 KB per block on an H100/H200, 163 KB on an
  A100, 64 KB on a T4) or until one program takes so much of an SM's shared memory that no second
  program fits beside it (occupancy).
* **num_warps** is how many warps (32 threads each) share a tile: the float32 accumulator of a
  128 x 256 tile is 128 KB of registers, 128 per thread with 8 warps; 4 warps would need 256 per
  thread, more than the 255 a thread may have, and would spill.

:func:`default_tiles` picks tiles by the GPU's compute capability (sm_90 and sm_80: 128 x 256 x 64,
GROUP_M 8, 8 warps, 3 stages for 16-bit types, as in Triton's tutorial; sm_75: 64 x 64 x 16, well
inside a T4's 64 KB and its registers; float32, which runs on the CUDA cores with
``input_precision="ieee"``, 64 x 64 x 32) and small tiles in Triton's interpreter, where a GPU's
tiles only make a CPU test slower.

Dtypes: ``a`` and ``b`` share one of float32, float16 and bfloat16; products accumulate in float32
(``"ieee"`` for float32 inputs: no TF32 rounding on a GPU). Any strides: a transposed view is read
through its strides, with no copy. Speed on a GPU needs rows that start 16-byte aligned (widths a
multiple of 16 elements, as a model's are): Triton then loads 16 bytes at a time and pipelines the
loads; an odd width compiles to one load per element. bfloat16 is refused in the interpreter
(numpy has no bfloat16 matmul). Launchers raise ``ValueError``/``TypeError`` naming the argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from llmu import runtime
from llmu.checks import FLOAT_DTYPES, require_same_dtype, require_tensor

__all__ = ["matmul", "Tiles", "default_tiles", "shared_memory_bytes", "shared_memory_limit", "fit_tiles",
           "INTERPRETER_TILES", "NUM_WARPS", "MAX_STAGES", "H100_SHARED_MEMORY"]

#: num_warps Triton accepts for a program: a power of two, 1 to 16 warps (32 to 512 threads).
NUM_WARPS = (1, 2, 4, 8, 16)
#: More stages than this only add shared memory: 3 or 4 already hide a GPU's memory latency.
MAX_STAGES = 6
#: Shared memory one block may use on an H100/H200 (compute capability 9.0): 227 KB.
H100_SHARED_MEMORY = runtime.SHARED_MEMORY_PER_BLOCK[(9, 0)]


@dataclass(frozen=True)
class Tiles:
    """How a matmul is cut up and launched: the ``BLOCK_M x BLOCK_N`` tile of ``C`` a program owns,
    the ``BLOCK_K`` step it walks ``K`` with, ``GROUP_M`` rows of tiles per group of the launch
    order, and the ``num_warps`` and ``num_stages`` Triton compiles it with. Checked when made:
    blocks are powers of two of at least 16 (``tl.dot``'s smallest tile)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            b = getattr(self, name)
            if isinstance(b, bool) or not isinstance(b, int):
                raise TypeError(f"tiles.{name} must be an int, got {b!r}")
            if b < 16 or b & (b - 1):
                raise ValueError(f"tiles.{name} must be a power of two of at least 16 (tl.dot's smallest "
                                 f"tile), got {b}")
        for name, ok, want in (("GROUP_M", lambda v: v >= 1, "a positive int"),
                               ("num_warps", lambda v: v in NUM_WARPS, f"one of {NUM_WARPS}"),
                               ("num_stages", lambda v: 1 <= v <= MAX_STAGES, f"an int from 1 to {MAX_STAGES}")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"tiles.{name} must be {want}, got {v!r}")
            if not ok(v):
                raise ValueError(f"tiles.{name} must be {want}, got {v}")

    @classmethod
    def of(cls, tiles) -> Tiles:
        """``tiles`` as :class:`Tiles`: one already, or a mapping of its fields (``dict(BLOCK_M=...)``)."""
        if isinstance(tiles, Tiles):
            return tiles
        if isinstance(tiles, Mapping):
            unknown = sorted(set(tiles) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"tiles: unknown keys {unknown}; the fields are {list(cls.__dataclass_fields__)}")
            return cls(**tiles)
        raise TypeError(f"tiles must be a Tiles or a dict of its fields, got {type(tiles).__name__}")

    def as_dict(self) -> dict:
        return asdict(self)


def shared_memory_bytes(tiles, elem_bytes: int) -> int:
    """Shared memory the kernel's pipeline needs, as Triton lays it out for ``tl.dot``:

        (BLOCK_M * BLOCK_K + BLOCK_K * BLOCK_N) * elem_bytes * num_stages

    each stage buffers one ``BLOCK_M x BLOCK_K`` slice of ``A`` and one ``BLOCK_K x BLOCK_N`` slice of
    ``B``. An estimate from below: the compiler may add a little (the epilogue's layout change, a
    barrier per stage), which ``llmu gpu-compile`` reports exactly. Example: 128 x 256 x 64 tiles in
    bf16 with 3 stages take (8192 + 16384) * 2 * 3 = 147,456 bytes, 144 KB."""
    t = Tiles.of(tiles)
    if isinstance(elem_bytes, bool) or not isinstance(elem_bytes, int) or elem_bytes < 1:
        raise ValueError(f"elem_bytes must be a positive int (2 for bf16/fp16, 4 for fp32), got {elem_bytes!r}")
    return (t.BLOCK_M * t.BLOCK_K + t.BLOCK_K * t.BLOCK_N) * elem_bytes * t.num_stages


#: Shared memory one block may use on the kernel GPU (``None`` in the interpreter).
shared_memory_limit = runtime.shared_memory_per_block


def fit_tiles(tiles, elem_bytes: int, limit: int | None = None) -> Tiles:
    """``tiles`` made to fit ``limit`` bytes of shared memory (default: :func:`shared_memory_limit`):
    fewer stages first, then a shorter ``BLOCK_K``. Unchanged when they fit, or in the interpreter."""
    t = Tiles.of(tiles)
    limit = shared_memory_limit() if limit is None else limit
    if limit is None:
        return t
    while shared_memory_bytes(t, elem_bytes) > limit and t.num_stages > 1:
        t = Tiles(**{**t.as_dict(), "num_stages": t.num_stages - 1})
    while shared_memory_bytes(t, elem_bytes) > limit and t.BLOCK_K > 16:
        t = Tiles(**{**t.as_dict(), "BLOCK_K": t.BLOCK_K // 2})
    return t


#: Triton's interpreter runs each program as numpy calls: small tiles keep ragged test shapes
#: several tiles large (masks and the grouped order are exercised) and cost nothing in speed there.
INTERPRETER_TILES = Tiles(32, 32, 32, GROUP_M=2, num_warps=4, num_stages=1)

# Candidates from the largest down; default_tiles takes the first that fits the GPU's shared memory.
_HALF_TILES = (
    Tiles(128, 256, 64, GROUP_M=8, num_warps=8, num_stages=3),   # sm_90, sm_80: 144 KB (Triton's tutorial)
    Tiles(128, 128, 64, GROUP_M=8, num_warps=4, num_stages=3),   # 99 KB parts (sm_86, sm_89): 96 KB
    # sm_75 (a T4, 64 KB): Triton builds its 16-bit tl.dot from registers, and larger tiles spill
    # them (``llmu gpu-compile`` shows it); 64 x 64 x 16 does not. 8 KB.
    Tiles(64, 64, 16, GROUP_M=8, num_warps=4, num_stages=2),
)
_FP32_TILES = (
    Tiles(64, 64, 32, GROUP_M=8, num_warps=4, num_stages=3),     # CUDA cores ("ieee"): 48 KB
    Tiles(64, 64, 32, GROUP_M=8, num_warps=4, num_stages=2),     # 32 KB
)


def default_tiles(dtype: torch.dtype) -> Tiles:
    """The tiles :func:`matmul` uses for inputs of ``dtype`` on the kernel GPU (by its compute
    capability and shared memory; see the module's docstring), or :data:`INTERPRETER_TILES`."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of float32, float16, bfloat16, got {dtype}")
    cap = runtime.capability()
    if cap is None:
        return INTERPRETER_TILES
    elem = torch.empty((), dtype=dtype).element_size()
    # sm_90/sm_80 take the tutorial's 3-stage 128 x 256 tile; older GPUs (a T4's 64 KB) start lower.
    candidates = _HALF_TILES if elem == 2 else _FP32_TILES
    if tuple(cap) < (8, 0):
        candidates = candidates[-1:]
    limit = shared_memory_limit()
    for t in candidates:
        if shared_memory_bytes(t, elem) <= limit:
            return t
    return fit_tiles(candidates[-1], elem, limit)


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # -- which tile of C this program computes: a 1-D grid, in grouped order. Program ids run down
    # -- GROUP_M rows of tiles, then move one column right, so the programs that run at the same
    # -- time share a few row panels of A and column panels of B (L2 hits instead of memory reads).
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)     # the last group may have fewer rows
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    # -- the tile's rows and columns (int64: offsets of large matrices pass 2**31 elements), and
    # -- pointers to the first BLOCK_K slice of A and of B, through their strides (a transposed
    # -- view costs nothing).
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    # -- walk K over the whole BLOCK_K steps: load a slice of A and of B (rows past M and columns
    # -- past N masked to 0), multiply-accumulate in float32. Triton pipelines these loads
    # -- num_stages deep; a mask along K here would keep it from doing so on an H100.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_whole = K - K % BLOCK_K
    for k0 in range(0, k_whole, BLOCK_K):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    # -- the last, ragged step when K is not a multiple of BLOCK_K: columns of A and rows of B
    # -- past K read 0, so they add nothing.
    if k_whole < K:
        k_ok = offs_k < K - k_whole
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)

    # -- write the tile once, in C's dtype, inside C only.
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"   # float32: no TF32 rounding on a GPU


def matmul(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None, tiles=None) -> torch.Tensor:
    """``a @ b`` for 2-D ``a`` ``(M, K)`` and ``b`` ``(K, N)`` of one float dtype, any strides.

    ``out``: an ``(M, N)`` tensor to write into (any strides: a slice of a larger tensor works), in
    the inputs' dtype or float32; a new one in the inputs' dtype when None. ``tiles``: a
    :class:`Tiles` or a dict of its fields; :func:`default_tiles` when None. Products accumulate
    in float32. Returns ``out``.
    """
    require_tensor("a", a, ndim=2, dtypes=FLOAT_DTYPES)
    require_tensor("b", b, ndim=2, dtypes=FLOAT_DTYPES)
    dtype = require_same_dtype(a=a, b=b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"b must have as many rows as a has columns (K): a is {tuple(a.shape)}, "
                         f"b is {tuple(b.shape)}")
    if dtype == torch.bfloat16 and runtime.interpreting():
        # the interpreter computes tl.dot with numpy, which has no bfloat16
        raise TypeError("a: bfloat16 needs a GPU (Triton's interpreter has no bfloat16 tl.dot); "
                        "use float32 or float16 on CPU")
    m, k_dim = a.shape
    n = b.shape[1]
    if b.device != a.device:
        raise ValueError(f"b is on {b.device} but a is on {a.device}; they must match")
    if out is None:
        out = torch.empty((m, n), dtype=dtype, device=a.device)
    else:
        require_tensor("out", out, ndim=2, dtypes=tuple(dict.fromkeys((dtype, torch.float32))))
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out must have shape (M, N) = {(m, n)}, got {tuple(out.shape)}")
        if out.device != a.device:
            raise ValueError(f"out is on {out.device} but a is on {a.device}; they must match")
    t = default_tiles(dtype) if tiles is None else Tiles.of(tiles)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, t.BLOCK_M) * triton.cdiv(n, t.BLOCK_N),)
    _matmul_kernel[grid](a, b, out, m, n, k_dim, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                         out.stride(0), out.stride(1),
                         BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, BLOCK_K=t.BLOCK_K, GROUP_M=t.GROUP_M,
                         PRECISION=_precision(dtype),
                         num_warps=t.num_warps, num_stages=t.num_stages)
    return out
