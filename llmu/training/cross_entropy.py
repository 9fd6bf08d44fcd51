"""Cross-entropy from hidden states, without the full logits: module 04's torch reference.

A language model's last step turns hidden states ``x`` ``(N, H)`` into logits ``x @ W^T``
``(N, V)`` with the LM head ``W`` ``(V, H)``, and the loss is the cross-entropy of those logits
against the next tokens ``y`` ``(N,)``. Written naively, ``F.cross_entropy(x @ W.T, y)`` keeps the
whole ``(N, V)`` logits alive for the backward pass, and autograd adds their gradient, another
``(N, V)``: at SmolLM2's vocabulary (``V = 49152``) and ``N = 2048`` tokens that is
``2048 * 49152 * 4 B = 403 MB`` per copy in float32, far more than the ``2048 * 576 * 4 B = 4.7 MB``
of hidden states that produced it.

The loss of row ``i`` needs only three numbers per row, each a sum over the vocabulary::

    lse_i   = log sum_j exp(z_ij)                  the log-sum-exp (softmax normaliser)
    z_i,y_i                                         the target's logit
    sum_j z_ij                                      (only for label smoothing)

    loss_i  = lse_i - (1 - eps) z_i,y_i - (eps / V) sum_j z_ij

(``eps`` is the label smoothing: the target distribution is ``(1 - eps)`` on ``y_i`` plus ``eps / V``
everywhere, as ``F.cross_entropy`` defines it.) So the vocabulary can be walked in chunks of
columns, keeping a running maximum ``m`` and a running ``s = sum exp(z - m)`` per row (the online
log-sum-exp of FlashAttention): when a chunk raises the maximum to ``m'``, the old sum is rescaled
by ``exp(m - m')``. Logits of 1e4 never overflow because every ``exp`` has a non-positive argument.

The gradient needs the logits again, but only one chunk at a time::

    dz_ij = g_i (softmax_ij - (1 - eps) [j = y_i] - eps / V)      g_i = upstream grad / n_valid (mean)
    dx    = dz @ W          dW = dz^T @ x

so the backward pass recomputes each chunk of logits from ``x`` and ``W`` (one more matmul, as
FlashAttention's backward does), turns it into ``dz`` with the saved ``lse``, and adds its share
to ``dx`` and ``dW``. Peak extra memory: one ``(row_chunk, vocab_chunk)`` tile plus the gradients
themselves. :func:`memory_bytes` writes both budgets out; :func:`measure_peak_memory` measures them.

Conventions (those of ``F.cross_entropy`` unless said):

- ``ignore_index`` rows contribute no loss and no gradient; ``reduction="mean"`` divides by the
  number of non-ignored rows, ``"sum"`` does not divide.
- **All rows ignored**: ``F.cross_entropy`` returns ``nan`` for ``"mean"`` (0 / 0). Here the loss
  is ``0`` with zero gradients: a micro-batch whose tokens are all masked (a prompt-only SFT
  sample) then adds nothing to training instead of poisoning it with ``nan``.
- Logits are computed in the inputs' dtype, as ``x @ W.T`` is, and reduced in float32; the loss is
  a float32 scalar.

The Triton version, fused with the matmul, is ``llmu.training.kernels.fused_linear_cross_entropy``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.checks import FLOAT_DTYPES, require_positive, require_same_device, require_same_dtype, require_tensor

__all__ = ["naive_cross_entropy", "chunked_cross_entropy", "check_inputs", "default_row_chunk", "memory_bytes",
           "measure_peak_memory", "row_gradient_scale", "REDUCTIONS", "TARGET_DTYPES", "REFERENCE_DTYPES"]

REDUCTIONS = ("mean", "sum")
TARGET_DTYPES = (torch.int32, torch.int64)
#: The reference also takes float64 (for gradient checks); the kernel takes ``FLOAT_DTYPES``.
REFERENCE_DTYPES = FLOAT_DTYPES + (torch.float64,)


def check_inputs(x, weight, target, ignore_index, label_smoothing, reduction, *, device=None,
                 dtypes=REFERENCE_DTYPES):
    """Validate the arguments shared by every cross-entropy here; return ``(x2, target1, N, H, V)``.

    ``x`` ``(..., H)`` and ``target`` ``x.shape[:-1]`` are flattened to ``(N, H)`` and ``(N,)``;
    ``weight`` is ``(V, H)`` in ``x``'s dtype and on its device. ``device`` is passed to
    :func:`llmu.checks.require_tensor` (``None``: any device; ``"kernel"``: the Triton device), and
    ``dtypes`` the float dtypes accepted.
    Targets must lie in ``[0, V)`` or equal ``ignore_index`` (checked: a wrong id would otherwise
    read another row's memory in a kernel, or silently never match a column).
    """
    require_tensor("x", x, dtypes=dtypes, device=device)
    require_tensor("weight", weight, ndim=2, dtypes=dtypes, device=device)
    require_tensor("target", target, dtypes=TARGET_DTYPES, device=device)
    require_same_dtype(x=x, weight=weight)
    require_same_device(x=x, weight=weight, target=target)
    if x.ndim < 2:
        raise ValueError(f"x must be (..., H) hidden states with at least 2 dimensions, got shape {tuple(x.shape)}")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"target must have shape {tuple(x.shape[:-1])} (x's shape without H), "
                         f"got {tuple(target.shape)}")
    vocab, hidden = weight.shape
    if hidden != x.shape[-1] or hidden == 0:
        raise ValueError(f"weight must be (V, H={x.shape[-1]}) with H > 0 to multiply x {tuple(x.shape)}, "
                         f"got shape {tuple(weight.shape)}")
    if vocab == 0:
        raise ValueError("weight must have at least one row (vocabulary size V > 0)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    x2 = x.reshape(-1, hidden)
    t1 = target.reshape(-1)
    bad = (t1 != ignore_index) & ((t1 < 0) | (t1 >= vocab))
    if t1.numel() and bool(bad.any()):
        raise ValueError(f"target must hold token ids in [0, {vocab}) or ignore_index={ignore_index}, "
                         f"got {int(t1[bad][0])}")
    return x2, t1, x2.shape[0], hidden, vocab


def default_row_chunk(n: int, hidden: int, vocab: int) -> int:
    """Rows per chunk so that a ``(rows, V)`` block of logits is about as large as ``x`` ``(N, H)``.

    Liger-Kernel's rule: ``V / H`` times fewer rows than ``N`` (rounded to a power of two), so the
    transient logits cost about what the hidden states already do. SmolLM2 (``V / H = 85.3``) with
    ``N = 2048``: 32 rows, a ``32 x 49152`` block.
    """
    factor = -(-vocab // hidden)
    rows = -(-n // factor)
    return max(1, min(n, 1 << (rows - 1).bit_length()))


def naive_cross_entropy(x, weight, target, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                        reduction: str = "mean") -> torch.Tensor:
    """The naive path: ``F.cross_entropy((x @ W^T).float(), y)``: the full ``(N, V)`` logits exist.

    With the conventions of this module (an all-ignored ``"mean"`` gives 0, not ``nan``).
    """
    x2, t1, _, _, _ = check_inputs(x, weight, target, ignore_index, label_smoothing, reduction)
    logits = (x2 @ weight.T).to(_accumulate_dtype(x2.dtype))
    loss = F.cross_entropy(logits, t1.long(), ignore_index=ignore_index, label_smoothing=float(label_smoothing),
                           reduction="sum")
    if reduction == "mean":
        loss = loss / (t1 != ignore_index).sum().clamp(min=1)
    return loss


def reduce_rows(row_loss, target, ignore_index, reduction):
    """The loss from per-row losses: their sum over the rows that are not ignored, over the number
    of those rows for ``"mean"`` (0 when every row is ignored; module docstring)."""
    valid = target != ignore_index
    loss = torch.where(valid, row_loss, 0.0).sum()
    if reduction == "mean":
        loss = loss / valid.sum().clamp(min=1)
    return loss


def row_gradient_scale(target, ignore_index, reduction, grad_output):
    """``g_i``: the upstream gradient over ``n_valid`` (mean) or 1 (sum), 0 on ignored rows (float32)."""
    valid = target != ignore_index
    scale = grad_output.to(_accumulate_dtype(grad_output.dtype))
    if reduction == "mean":
        scale = scale / valid.sum().clamp(min=1)
    return torch.where(valid, scale, torch.zeros((), dtype=scale.dtype, device=target.device))


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the float32/16 inputs, float64 for float64 ones (the gradient-check dtype)."""
    return torch.promote_types(dtype, torch.float32)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward: online log-sum-exp over vocabulary chunks. Backward: recompute each chunk of logits."""

    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, eps, reduction, row_chunk, vocab_chunk):
        n, vocab = x.shape[0], weight.shape[0]
        acc = _accumulate_dtype(x.dtype)
        lse = torch.empty(n, dtype=acc, device=x.device)
        row_loss = torch.empty(n, dtype=acc, device=x.device)
        for r0 in range(0, n, row_chunk):
            xr, yr = x[r0:r0 + row_chunk], target[r0:r0 + row_chunk].long()
            rows = xr.shape[0]
            m = torch.full((rows,), float("-inf"), dtype=acc, device=x.device)   # running max
            s = torch.zeros(rows, dtype=acc, device=x.device)       # running sum of exp(z - m)
            z_target = torch.zeros(rows, dtype=acc, device=x.device)
            z_total = torch.zeros(rows, dtype=acc, device=x.device)  # sum_j z_j, for smoothing
            for v0 in range(0, vocab, vocab_chunk):
                # Step 1: one (rows, vocab_chunk) tile of logits, in the inputs' dtype, reduced in float32
                z = (xr @ weight[v0:v0 + vocab_chunk].T).to(acc)
                # Step 2: the online log-sum-exp: rescale the old sum to the new maximum
                m_new = torch.maximum(m, z.amax(dim=1))
                s = s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(dim=1)
                m = m_new
                # Step 3: pick up the target's logit if it falls in this tile, and the row sum
                inside = (yr >= v0) & (yr < v0 + z.shape[1])
                local = (yr - v0).clamp(0, z.shape[1] - 1)
                z_target += torch.where(inside, z.gather(1, local[:, None])[:, 0], 0.0)
                z_total += z.sum(dim=1)
            lse[r0:r0 + rows] = m + torch.log(s)
            row_loss[r0:r0 + rows] = lse[r0:r0 + rows] - (1.0 - eps) * z_target - (eps / vocab) * z_total
        loss = reduce_rows(row_loss, target, ignore_index, reduction)
        ctx.save_for_backward(x, weight, target, lse)
        ctx.settings = (ignore_index, eps, reduction, row_chunk, vocab_chunk)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, target, lse = ctx.saved_tensors
        ignore_index, eps, reduction, row_chunk, vocab_chunk = ctx.settings
        n, vocab = x.shape[0], weight.shape[0]
        acc = _accumulate_dtype(x.dtype)
        scale = row_gradient_scale(target, ignore_index, reduction, grad_loss.expand(n))
        # A frozen LM head (LoRA) needs no dW: skip its V x H buffer and half of the matmuls
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = torch.zeros(x.shape, dtype=acc, device=x.device) if need_dx else None
        dw = torch.zeros(weight.shape, dtype=acc, device=x.device) if need_dw else None
        for r0 in range(0, n, row_chunk):
            xr, yr = x[r0:r0 + row_chunk], target[r0:r0 + row_chunk].long()
            for v0 in range(0, vocab, vocab_chunk):
                w_tile = weight[v0:v0 + vocab_chunk]
                # Step 1: recompute the tile of logits, and its softmax from the saved lse
                z = (xr @ w_tile.T).to(acc)
                dz = torch.exp(z - lse[r0:r0 + row_chunk, None])
                # Step 2: minus the smoothed one-hot target, times the row's scale
                dz -= eps / vocab
                inside = (yr >= v0) & (yr < v0 + z.shape[1])
                rows = torch.nonzero(inside)[:, 0]
                dz[rows, yr[rows] - v0] -= 1.0 - eps
                dz *= scale[r0:r0 + row_chunk, None].to(acc)
                # Step 3: this tile's share of the gradients that are needed
                if need_dx:
                    dx[r0:r0 + row_chunk] += dz @ w_tile.to(acc)
                if need_dw:
                    dw[v0:v0 + vocab_chunk] += dz.T @ xr.to(acc)
        dx = dx.to(x.dtype) if need_dx else None
        dw = dw.to(weight.dtype) if need_dw else None
        return dx, dw, None, None, None, None, None, None


def chunked_cross_entropy(x, weight, target, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                          reduction: str = "mean", row_chunk: int | None = None,
                          vocab_chunk: int = 4096) -> torch.Tensor:
    """``cross_entropy(x @ W^T, y)`` over ``(row_chunk, vocab_chunk)`` tiles: the ``(N, V)`` logits never exist.

    ``x`` ``(..., H)``, ``weight`` ``(V, H)`` (the LM head, ``nn.Linear`` layout), ``target``
    ``x.shape[:-1]`` int64/int32. Differentiable in ``x`` and ``weight`` (the backward pass
    recomputes each tile of logits). ``row_chunk`` defaults to :func:`default_row_chunk`.
    """
    x2, t1, n, hidden, vocab = check_inputs(x, weight, target, ignore_index, label_smoothing, reduction)
    row_chunk = default_row_chunk(n, hidden, vocab) if row_chunk is None else row_chunk
    require_positive("row_chunk", row_chunk, integer=True)
    require_positive("vocab_chunk", vocab_chunk, integer=True)
    return _ChunkedCrossEntropy.apply(x2, weight, t1, ignore_index, float(label_smoothing), reduction,
                                      row_chunk, vocab_chunk)


def memory_bytes(n: int, hidden: int, vocab: int, *, elem: int = 4, row_chunk: int | None = None,
                 vocab_chunk: int = 4096) -> dict:
    """The transient memory of one forward + backward, in bytes, beyond the inputs and the gradients.

    - ``naive``: ``x @ W^T`` ``(N, V)`` in the inputs' dtype (``elem`` bytes) kept for backward,
      its float32 copy (only when ``elem != 4``), ``F.cross_entropy``'s saved log-softmax
      ``(N, V)`` float32, and in backward the gradient of the logits ``(N, V)``: about
      ``N·V·(elem + 4 + 4)`` (plus the float32 copy's ``4·N·V`` for half precision) — the
      ``(N, V)`` terms are everything here;
    - ``chunked``: one ``(row_chunk, vocab_chunk)`` tile of logits in the inputs' dtype, its float32
      copy and the exponentials (``dz`` in backward), so about ``r·c·(elem + 8)``; the float32
      products ``dz @ W_tile`` ``(r, H)`` and ``dz^T @ x_chunk`` ``(c, H)`` before they are added
      to the gradients (``4·(r + c)·H``); the
      per-row statistics ``lse`` and the row losses (``8·N``) and, for half-precision inputs, the
      float32 accumulators of ``dx`` and ``dW`` (``4·(N + V)·H``; in float32 they are the gradients).
    """
    for name, value in (("n", n), ("hidden", hidden), ("vocab", vocab), ("elem", elem), ("vocab_chunk", vocab_chunk)):
        require_positive(name, value, integer=True)
    rows = default_row_chunk(n, hidden, vocab) if row_chunk is None else require_positive("row_chunk", row_chunk,
                                                                                        integer=True)
    cols = min(vocab_chunk, vocab)
    naive = n * vocab * (elem + 4 + 4 + (0 if elem == 4 else 4))
    rows = min(rows, n)
    chunked = (rows * cols * (elem + 8) + 8 * n + 4 * (rows + cols) * hidden
               + (0 if elem == 4 else 4 * (n + vocab) * hidden))
    return {"naive": naive, "chunked": chunked, "logits": n * vocab * elem, "row_chunk": rows,
            "vocab_chunk": cols}


def measure_peak_memory(n: int = 2048, hidden: int = 576, vocab: int = 49152, *, dtype=torch.float32,
                        seed: int = 0, vocab_chunk: int = 4096) -> dict:
    """Measure the peak extra memory of forward + backward, naive vs chunked, on the CPU.

    Method: the tensor watcher of :mod:`llmu.flash.memory` (a ``TorchDispatchMode`` that sees the
    outputs of every op, the backward's included) adds up the bytes of the storages alive at each
    moment and keeps the largest total. The storages of ``x`` and ``W`` are registered with it
    first, at zero bytes: views of the inputs (``W.T``, the slices, the aliases autograd makes)
    then cost nothing, as in memory. The gradients ``x.grad`` and ``W.grad`` are made inside the
    measured call and counted for both paths (``gradients``: ``4·(N + V)·H`` bytes in float32).
    Also returns both losses, so a caller can see the two paths agree.
    """
    from llmu.flash.memory import LiveBytes

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, hidden, generator=g, device="cpu").to(dtype).requires_grad_(True)
    weight = (torch.randn(vocab, hidden, generator=g, device="cpu") * hidden ** -0.5).to(dtype).requires_grad_(True)
    target = torch.randint(0, vocab, (n,), generator=g, device="cpu")

    def run(loss_fn):
        loss = loss_fn(x, weight, target)
        loss.backward()
        return float(loss.detach())

    def peak(loss_fn):
        x.grad = weight.grad = None
        tracker = LiveBytes(exclude=(x, weight, target))     # the inputs exist already: never counted
        with tracker:
            loss = run(loss_fn)
        return loss, tracker.peak

    naive_loss, naive_peak = peak(naive_cross_entropy)
    chunked_loss, chunked_peak = peak(lambda a, b, c: chunked_cross_entropy(a, b, c, vocab_chunk=vocab_chunk))
    return {"naive": naive_peak, "chunked": chunked_peak, "naive_loss": naive_loss, "chunked_loss": chunked_loss,
            "gradients": (x.numel() + weight.numel()) * x.element_size(),
            "formula": memory_bytes(n, hidden, vocab, elem=x.element_size(), vocab_chunk=vocab_chunk)}
