"""Training batches drawn from one long array of token ids, which may be larger than memory.

A pretraining corpus is tokenized once into a flat file of ids (``uint16`` when the vocabulary
has fewer than 65,536 entries: 2 bytes a token). Opened with ``np.memmap``, that file is an array
whose pages the operating system reads from disk only when they are touched, so a 100 GB corpus
costs nothing to "load". :func:`get_batch` keeps that promise: it draws ``batch_size`` random
start positions and reads only those windows (``tokens[starts[:, None] + arange(T + 1)]`` touches
``batch_size · (T + 1)`` ids), never ``np.asarray(tokens)`` or ``torch.from_numpy(tokens)`` of
the whole array.

Each window is ``context_length + 1`` consecutive ids: the inputs ``x`` are its first
``context_length``, the targets ``y`` its last ``context_length``, so ``y[b, t] = x[b, t + 1]``:
position ``t`` is scored on predicting the id that follows it. A window may start anywhere from 0
to ``n − context_length − 1`` (the last window ends on the last id): ``n − context_length``
possible starts, drawn uniformly by ``torch.randint`` from ``generator`` (torch's global one if
``None``). Saving that generator's state with a checkpoint (``llmu.training.checkpoint``) makes a
resumed run draw the batches the uninterrupted run would have drawn.

>>> import numpy as np, torch
>>> x, y = get_batch(np.arange(100, dtype=np.uint16), 4, 8, generator=torch.Generator().manual_seed(0))
>>> x.shape, x.dtype, bool((y == x + 1).all())
(torch.Size([4, 8]), torch.int64, True)
"""

from __future__ import annotations

import numpy as np
import torch

from llmu.checks import require_int

__all__ = ["get_batch"]


def get_batch(tokens, batch_size: int, context_length: int, device=None, *,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``tokens``: inputs ``x`` and targets ``y``, both int64
    ``(batch_size, context_length)``, with ``y[:, t] == x[:, t + 1]`` (module docstring).

    ``tokens``: a 1-D integer ``np.ndarray`` or ``np.memmap`` (only the sampled windows are read)
    or a 1-D integer ``torch.Tensor``, holding at least ``context_length + 1`` ids. ``device``:
    where the batch goes (``None``: the CPU). ``generator``: a CPU ``torch.Generator`` that draws
    the start positions.
    """
    batch_size = require_int("batch_size", batch_size, 1)
    context_length = require_int("context_length", context_length, 1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if isinstance(tokens, torch.Tensor):
        kind_ok = not (tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool)
    elif isinstance(tokens, np.ndarray):               # np.memmap is an ndarray
        kind_ok = np.issubdtype(tokens.dtype, np.integer)
    else:
        raise TypeError(f"tokens must be a 1-D np.ndarray, np.memmap or torch.Tensor of token ids, "
                        f"got {type(tokens).__name__}")
    if tokens.ndim != 1 or not kind_ok:
        raise ValueError(f"tokens must be a 1-D array of integer ids, got shape {tuple(tokens.shape)} "
                         f"and dtype {tokens.dtype}")
    n = tokens.shape[0]
    if n < context_length + 1:
        raise ValueError(f"tokens holds {n} ids: too few for one window of context_length + 1 = {context_length + 1}")

    # starts in [0, n - T - 1]: randint's upper bound is exclusive
    starts = torch.randint(0, n - context_length, (batch_size,), generator=generator)
    offsets = torch.arange(context_length + 1)
    if isinstance(tokens, torch.Tensor):
        windows = tokens[(starts[:, None] + offsets).to(tokens.device)].to(torch.int64)
    else:
        # fancy indexing gathers only these B (T + 1) ids: a memmap reads just their pages
        index = starts.numpy()[:, None] + offsets.numpy()
        windows = torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))
    x, y = windows[:, :-1], windows[:, 1:]
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x.contiguous(), y.contiguous()
