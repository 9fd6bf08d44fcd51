"""Synthetic tasks of module 13: copying, and the selective copying of the Mamba paper.

Selective copying (Gu & Dao, 2023, section 4.1.1 and Fig. 2) asks a sequence model to **remember
some tokens and ignore others**. A sequence holds a *context* of ``context_len`` positions, most of
them a noise token, with ``n_data`` data tokens scattered at random positions; then ``n_data``
marker tokens. At each marker the model must output the next data token, in the order they
appeared::

    context (noise . and data A..)            markers       what is scored
    . C . . A . . . D . . . B . . .           # # # #       C A D B   (at the four markers)

**Copying** is the same with the data at fixed positions (here the first ``n_data`` of the
context): the distance from each data token to the marker that asks for it is the same in every
sequence. A linear time-invariant (LTI) model such as S4 solves it with one fixed convolution
kernel ("shift by ``context_len``"). When the positions vary, no fixed kernel works: the model has
to decide *from the token's content* whether to write it into its state, which is what
input-dependent ``Δ``, ``B`` and ``C`` let a selective SSM do.

Token ids: ``0`` is noise, ``1 .. n_symbols`` are data, ``n_symbols + 1`` is the marker, so the
vocabulary has ``n_symbols + 2`` tokens (:func:`vocab_size`). A batch is a :class:`CopyBatch`:
``inputs`` ``(B, context_len + n_data)``, ``targets`` of the same shape holding the data token at
each marker position and :data:`IGNORE` elsewhere (so ``F.cross_entropy(..., ignore_index=IGNORE)``
scores the answers only), and ``answer`` ``(B, n_data)``, the data tokens in order.

The model sees the whole input at once (as in the paper's task: the markers do not reveal the
previous answers), so at marker ``i`` it must know both *which* data token is the ``i``-th and that
this is the ``i``-th marker. A causal model reads the context before the markers, which is what
makes the task possible at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["NOISE", "IGNORE", "CopyBatch", "vocab_size", "marker_token", "copying_batch",
           "selective_copying_batch", "answer_loss", "answer_accuracy"]

#: The noise (blank) token.
NOISE = 0
#: The target at positions that are not scored (``F.cross_entropy``'s default ``ignore_index``).
IGNORE = -100


@dataclass
class CopyBatch:
    """One batch of a copying task (module docstring): ``inputs``, ``targets``, ``answer``."""

    inputs: torch.Tensor     # (B, context_len + n_data) int64: context, then markers
    targets: torch.Tensor    # (B, context_len + n_data) int64: the data token at each marker, IGNORE elsewhere
    answer: torch.Tensor     # (B, n_data) int64: the data tokens in order of appearance

    @property
    def mask(self) -> torch.Tensor:
        """``(B, T)`` bool: the scored (answer) positions."""
        return self.targets != IGNORE


def vocab_size(n_symbols: int) -> int:
    """Noise, ``n_symbols`` data tokens and the marker."""
    return n_symbols + 2


def marker_token(n_symbols: int) -> int:
    return n_symbols + 1


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _make_batch(batch: int, context_len: int, n_data: int, n_symbols: int, positions: torch.Tensor,
                generator: torch.Generator) -> CopyBatch:
    """Fill a noise context with random data tokens at ``positions`` ``(B, n_data)`` (sorted)."""
    data = torch.randint(1, n_symbols + 1, (batch, n_data), generator=generator)
    context = torch.full((batch, context_len), NOISE, dtype=torch.long)
    context.scatter_(1, positions, data)
    markers = torch.full((batch, n_data), marker_token(n_symbols), dtype=torch.long)
    inputs = torch.cat([context, markers], dim=1)
    targets = torch.full_like(inputs, IGNORE)
    targets[:, context_len:] = data               # marker i asks for the i-th data token
    return CopyBatch(inputs, targets, data)


def _check_sizes(batch, context_len, n_data, n_symbols):
    _check_int("batch", batch, 1)
    _check_int("n_data", n_data, 1)
    _check_int("n_symbols", n_symbols, 1)
    _check_int("context_len", context_len, 1)
    if n_data > context_len:
        raise ValueError(f"n_data ({n_data}) must be at most context_len ({context_len}): "
                         "every data token needs its own position")


def selective_copying_batch(batch: int, context_len: int, n_data: int, n_symbols: int,
                            generator: torch.Generator | int | None = None) -> CopyBatch:
    """Selective copying: ``n_data`` data tokens at random positions (distinct, uniformly drawn) of a
    noise context of ``context_len`` positions, then ``n_data`` markers. ``generator``: a
    ``torch.Generator`` or an int seed, for reproducible batches."""
    _check_sizes(batch, context_len, n_data, n_symbols)
    g = _generator(generator)
    # n_data distinct positions per row: the first n_data of a random permutation, sorted
    positions = torch.rand(batch, context_len, generator=g).argsort(dim=1)[:, :n_data].sort(dim=1).values
    return _make_batch(batch, context_len, n_data, n_symbols, positions, g)


def copying_batch(batch: int, context_len: int, n_data: int, n_symbols: int,
                  generator: torch.Generator | int | None = None) -> CopyBatch:
    """Plain copying: the data tokens fill the first ``n_data`` positions of the context, every time
    (a fixed distance to the markers: the LTI-solvable control)."""
    _check_sizes(batch, context_len, n_data, n_symbols)
    g = _generator(generator)
    positions = torch.arange(n_data).expand(batch, n_data).contiguous()
    return _make_batch(batch, context_len, n_data, n_symbols, positions, g)


def _generator(generator) -> torch.Generator:
    if isinstance(generator, torch.Generator):
        return generator
    if generator is None:
        return torch.Generator().manual_seed(torch.seed() % 2**63)
    if isinstance(generator, bool) or not isinstance(generator, int):
        raise TypeError(f"generator must be a torch.Generator, an int seed or None, got {type(generator).__name__}")
    return torch.Generator().manual_seed(generator)


def _check_logits(logits: torch.Tensor, batch: CopyBatch) -> None:
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or logits.shape[:2] != batch.inputs.shape:
        raise ValueError(f"logits must have shape (B, T, V) with (B, T) = {tuple(batch.inputs.shape)}, "
                         f"got {tuple(getattr(logits, 'shape', ()))}")


def answer_loss(logits: torch.Tensor, batch: CopyBatch) -> torch.Tensor:
    """Mean cross-entropy over the answer (marker) positions only; ``logits`` ``(B, T, V)``."""
    _check_logits(logits, batch)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch.targets.reshape(-1),
                           ignore_index=IGNORE)


@torch.no_grad()
def answer_accuracy(logits: torch.Tensor, batch: CopyBatch) -> float:
    """Fraction of answer positions where the argmax is the right data token (chance:
    ``1 / n_symbols`` for a model that has learnt to answer with *some* data token)."""
    _check_logits(logits, batch)
    mask = batch.mask
    right = (logits.argmax(-1) == batch.targets) & mask
    return float(right.sum()) / float(mask.sum())
