"""GPTQ (Frantar et al., 2022): quantize a weight one column at a time, and let the rest make up for it.

RTN rounds every weight to its nearest code on its own. What a layer is judged by is its output on
real inputs ``X`` (``(K, n)``: ``n`` calibration tokens), so the quantity to keep small is

    || W X - Q X ||^2  =  sum over rows r of  (w_r - q_r) H (w_r - q_r)^T / 2,     H = 2 X X^T / n

(up to the factor ``n``). ``H`` (``(K, K)``, the *Hessian* of that loss) says how the inputs are
correlated: when input ``j`` moves with input ``k``, an error made rounding column ``j`` can be
cancelled by nudging column ``k``. GPTQ (after Optimal Brain Quantization) quantizes the columns
left to right; after column ``j`` it knows its error ``w_j - q_j`` and updates the columns not yet
quantized by the least-squares correction::

    err_j = (w_j - q_j) / Hinv[j, j]            w[:, j+1:] -= err_j  Hinv[j, j+1:]

where ``Hinv`` is the *upper Cholesky factor* of ``H^-1``: row ``j`` of it holds exactly the inverse
Hessian of the columns ``j..K-1`` that remain after ``0..j-1`` are fixed, so one factorisation
serves every step. The rows are independent (same ``H``), so all ``N`` rows go together.

The details of the reference implementation, kept here:

- *dead inputs*: an input that is zero on every calibration token has ``H_jj = 0``; its column
  does not matter to the output, so it is set to zero and ``H_jj`` to 1 (keeps ``H`` invertible);
- *damping*: ``lambda = percdamp * mean(diag H)`` (``percdamp = 0.01``) is added to the diagonal:
  a few thousand tokens give a nearly singular ``H`` and the Cholesky factorisation needs margin.
  Damping is also regularisation: GPTQ minimises the error *on the calibration tokens*, and with
  few of them (SmolLM2's ``down_proj`` has 1,536 inputs; the course's text gives 2,500 tokens,
  the paper used 128 x 2,048) it fits them too well and does worse than RTN on new text.
  ``percdamp = 0.1`` pulls ``H`` toward the identity (towards RTN) and generalises there;
- *lazy batches*: the update of the far columns is deferred and applied once per block of 128
  columns (one matrix product instead of 128 rank-1 updates); the result is the same;
- *groups*: a group's scale and zero are computed when its first column is reached, from the
  weights as the error feedback has already changed them;
- *act_order*: the columns go in order of decreasing ``H_jj`` (the inputs with the most energy
  first, while many columns remain to absorb their error). The storage format needs groups of
  consecutive inputs, so with ``granularity="group"`` act_order uses *static groups*: all
  scales and zeros are computed from the original weights before the loop (as the reference's
  ``--static-groups`` does), and every column still uses its own group's parameters.

Two exact properties the tests check: with a diagonal ``H`` (uncorrelated inputs, or ``H = I``)
the Cholesky factor of ``H^-1`` is diagonal, the update ``err_j Hinv[j, j+1:]`` is zero, and GPTQ
returns RTN's codes exactly, damping or not. And the first column (the first group's
parameters too) is RTN's: nothing has been fed back to it yet.

:func:`gptq_quantize` quantizes one weight given ``H``; :func:`hessian` builds ``H`` from inputs;
:func:`quantize_model_gptq` runs the whole model, block by block (``llmu.quant.calibration``).
"""

from __future__ import annotations

import copy
import math

import torch

from llmu.quant.formats import QuantizedTensor, _check_format, check_weight, quant_params

__all__ = ["check_model_format", "gptq_quantize", "hessian", "output_error", "quantize_model_gptq"]


def hessian(x: torch.Tensor, h: torch.Tensor | None = None, n: int = 0) -> tuple[torch.Tensor, int]:
    """``H = 2 X X^T / n`` from inputs ``x`` ``(tokens, K)`` (any leading dims), accumulated.

    Pass the previous ``(h, n)`` to add more tokens: the running mean keeps ``H`` equal to the one
    built from all the tokens at once. Returns ``(H (K, K) float32, n)``.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor of inputs, got {getattr(x, 'dtype', type(x).__name__)}")
    x = x.reshape(-1, x.shape[-1]).float()
    m = x.shape[0]
    if h is None:
        h = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    elif h.shape != (x.shape[1], x.shape[1]):
        raise ValueError(f"h must be ({x.shape[1]}, {x.shape[1]}) for inputs with {x.shape[1]} features, got {tuple(h.shape)}")
    total = n + m
    if total == 0:
        return h, 0
    # -- the running mean: scale the old sum down, add the new tokens scaled by sqrt(2 / total)
    h = h * (n / total)
    xs = x * math.sqrt(2.0 / total)
    return h + xs.T @ xs, total


def output_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """``|| x W^T - x W_hat^T ||_F`` for inputs ``x`` ``(tokens, K)``: what quantization costs a layer."""
    return float(torch.linalg.matrix_norm(x.float() @ (w.float() - w_hat.float()).T))


def _check_h(h, k: int) -> torch.Tensor:
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"H must be a torch.Tensor, got {type(h).__name__}")
    if not h.is_floating_point():
        raise TypeError(f"H must be floating point, got {h.dtype}")
    if h.shape != (k, k):
        raise ValueError(f"H must be (K, K) = ({k}, {k}) for a weight with K = {k} inputs, got {tuple(h.shape)}")
    if not torch.isfinite(h).all():
        raise ValueError("H holds inf or nan")
    if (torch.diagonal(h) < 0).any():
        raise ValueError("H has negative diagonal entries: it must be 2 X X^T / n, positive semi-definite")
    return h


def _round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Codes of ``w`` with the given scale and zero (broadcast), clamped to 0..maxq."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, bits: int = 4, *, group_size: int = 128,
                  symmetric: bool = False, granularity: str = "group", percdamp: float = 0.01,
                  blocksize: int = 128, act_order: bool = False, static_groups: bool = False) -> QuantizedTensor:
    """GPTQ codes for ``w`` ``(N, K)`` given the Hessian ``H`` ``(K, K)`` of its inputs (see the module).

    Same format arguments as :func:`llmu.quant.formats.quantize`, and: ``percdamp``, the damping as
    a fraction of the mean diagonal of ``H``; ``blocksize``, the columns of a lazy batch;
    ``act_order``, quantize inputs by decreasing ``H_jj``; ``static_groups``, compute every group's
    scale and zero from the original weights first (implied by ``act_order`` with groups).
    Neither ``w`` nor ``H`` is modified.
    """
    check_weight(w)
    n, k = w.shape
    g = _check_format(bits, granularity, group_size, k)
    H = _check_h(H, k)
    if isinstance(percdamp, bool) or not isinstance(percdamp, (int, float)) or not 0 <= percdamp < 1e6 \
            or not math.isfinite(percdamp):
        raise ValueError(f"percdamp must be a non-negative number (0.01 in the paper), got {percdamp!r}")
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize < 1:
        raise ValueError(f"blocksize must be a positive int, got {blocksize!r}")
    maxq = 2**bits - 1
    W = w.detach().float().clone()
    H = H.detach().float().clone().to(W.device)

    # -- dead inputs: zero on every calibration token; their columns cannot matter
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    # -- parameters fixed before the loop: one tensor scale, or every group's (static groups)
    static = None
    if granularity == "tensor":
        s, z = quant_params(W.reshape(1, -1), bits, symmetric=symmetric)
        static = (s.expand(n, 1), z.expand(n, 1))
    elif granularity == "group" and (static_groups or act_order) and g < k:
        s, z = quant_params(W.reshape(n * k // g, g), bits, symmetric=symmetric)
        static = (s.reshape(n, k // g), z.reshape(n, k // g))
    scale = torch.empty(n, k // g)
    zero = torch.empty(n, k // g)
    if static is not None:
        scale[:], zero[:] = static

    perm = torch.arange(k, device=W.device)
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]

    # -- damping, then Hinv = upper Cholesky factor of H^-1
    damp = percdamp * torch.diagonal(H).mean()
    H[range(k), range(k)] += damp
    try:
        L = torch.linalg.cholesky(H)
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    except torch.linalg.LinAlgError as exc:
        raise ValueError(f"H (damped by percdamp={percdamp}) is not positive definite: raise percdamp") from exc

    Q = torch.zeros_like(W)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])  # the input this column is, in the original order
            grp = col // g
            if static is None and (i1 + i) % g == 0:  # (no static params: columns in order, or one group)
                # -- a group starts: its parameters from the current (error-updated) weights; the
                # columns past this block have not yet received this block's updates: add them
                cur = W1[:, i:i + g]
                if i + g > i2 - i1:
                    far = W[:, i2:i1 + i + g] - Err1[:, :i] @ Hinv[i1:i1 + i, i2:i1 + i + g]
                    cur = torch.cat([cur, far], dim=1)
                s, z = quant_params(cur, bits, symmetric=symmetric)
                scale[:, grp], zero[:, grp] = s[:, 0], z[:, 0]
            # -- round this column, then push its error onto the columns of the block to its right
            wcol = W1[:, i]
            qcode = _round(wcol, scale[:, grp], zero[:, grp], maxq)
            Q[:, i1 + i] = qcode
            qval = (qcode - zero[:, grp]) * scale[:, grp]
            err = (wcol - qval) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        # -- lazy batch: the far columns get the whole block's updates in one product
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    if act_order:
        Q = Q[:, torch.argsort(perm)]
    return QuantizedTensor(Q.to(torch.uint8), scale.contiguous(), zero.contiguous(), bits, g, symmetric,
                           granularity, w.dtype)


def check_model_format(model, bits, granularity, group_size, skip=()) -> None:
    """Fail before any calibration work when the format does not fit some projection of ``model``."""
    if not hasattr(model, "layers"):
        raise TypeError(f"model must be an llmu LlamaModel, got {type(model).__name__}")
    if isinstance(skip, str):
        raise TypeError(f"skip must be a collection of names, not a str (write skip=({skip!r},))")
    for li, layer in enumerate(model.layers):
        for name, mod in layer.named_modules():
            if hasattr(mod, "weight") and hasattr(mod, "in_features") and not _skipped(f"layers.{li}.{name}", skip):
                _check_format(bits, granularity, group_size, mod.in_features)


def _skipped(name: str, skip) -> bool:
    """As in ``llmu.quant.apply``: an entry of ``skip`` equal to ``name``, or a dotted suffix
    (``"down_proj"``) or prefix (``"layers.0"``) of it."""
    return any(name == p or name.endswith("." + p) or name.startswith(p + ".") for p in skip)


def _calibration_batch(calibration, n_samples, seq_len, seed) -> torch.Tensor:
    from llmu.quant.calibration import calibration_ids

    if calibration is None or (isinstance(calibration, torch.Tensor) and calibration.ndim == 1) \
            or isinstance(calibration, (list, tuple)):
        return calibration_ids(calibration, n_samples=n_samples, seq_len=seq_len, seed=seed)
    if isinstance(calibration, torch.Tensor) and calibration.ndim == 2 and not calibration.is_floating_point():
        return calibration
    raise TypeError("calibration must be None (the essays), a 1-D tensor of token ids to cut windows from, "
                    f"or (n_samples, seq_len) token ids; got {getattr(calibration, 'shape', type(calibration).__name__)}")


def quantize_model_gptq(model, calibration=None, bits: int = 4, *, group_size: int = 128, symmetric: bool = False,
                        granularity: str = "group", inplace: bool = False, skip=(), percdamp: float = 0.01,
                        blocksize: int = 128, act_order: bool = False, static_groups: bool = False,
                        n_samples: int = 16, seq_len: int = 256, seed: int = 0, batch_size: int = 8,
                        log=None):
    """Every projection of the blocks quantized with GPTQ; returns the model (a copy unless ``inplace``).

    ``calibration``: ``(n_samples, seq_len)`` token ids, or a 1-D tensor of ids to cut
    ``n_samples`` windows of ``seq_len`` from (seeded), or None for the first half of the essays.
    Blocks are processed in order; inside a block the projections go group by group
    (``llmu.quant.calibration.SEQUENTIAL_GROUPS``), each calibrated on the outputs of the
    already-quantized ones. ``skip``: projection names (``"layers.0.mlp.down_proj"``, a suffix such
    as ``"down_proj"``, a prefix such as ``"layers.0"``) left in float. ``log``: called with a line per block.
    """
    from llmu.quant.calibration import SEQUENTIAL_GROUPS, BlockRunner
    from llmu.quant.linear import QuantLinear

    check_model_format(model, bits, granularity, group_size, skip)
    ids = _calibration_batch(calibration, n_samples, seq_len, seed)
    if not inplace:
        model = copy.deepcopy(model)
    runner = BlockRunner(model, ids, batch_size=batch_size)
    fmt = dict(group_size=group_size, symmetric=symmetric, granularity=granularity, percdamp=percdamp,
               blocksize=blocksize, act_order=act_order, static_groups=static_groups)
    for li, layer in enumerate(model.layers):
        for group in SEQUENTIAL_GROUPS:
            names = [nm for nm in group if not _skipped(f"layers.{li}.{nm}", skip)]
            if not names:
                continue
            inputs = runner.capture(layer, names)
            for nm in names:
                parent_name, _, child = nm.rpartition(".")
                parent = layer.get_submodule(parent_name)
                lin = getattr(parent, child)
                H, _ = hessian(inputs[nm])
                qt = gptq_quantize(lin.weight, H, bits, **fmt)
                bias = None if lin.bias is None else lin.bias.detach().clone()
                setattr(parent, child, QuantLinear(qt, bias))
            del inputs
        runner.advance(layer)
        if log is not None:
            log(f"gptq: layer {li} done")
    return model
