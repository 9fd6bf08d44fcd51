"""Perplexity of a language model on a text, with the standard sliding-window evaluation.

Perplexity is ``exp`` of the mean negative log-likelihood the model gives each token of a text,
given the tokens before it: ``exp(-(1/N) sum_t log p(x_t | x_<t))``. A model that spreads its
probability evenly over a vocabulary of ``V`` tokens scores exactly ``V``; lower is better.

A text longer than the model's window cannot be scored in one forward pass. The strided
evaluation slides a ``window`` of tokens along the text by ``stride`` tokens at a time, and each
window scores only the tokens the previous windows did not score: every token is predicted once,
with at least ``window - stride`` tokens of context (except those near the start, which have
what there is). A window of ``window`` tokens makes ``window - 1`` predictions (its first token
has nothing before it in the window), so ``stride`` is at most ``window - 1``: that largest
stride is fastest and gives the least context; smaller strides cost more passes and give a
lower, more faithful perplexity. The last window is moved back so that
it ends on the last token, which keeps every window the same length so that windows are batched.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["perplexity", "token_nlls", "windows"]


def windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """The ``(begin, end, first_scored)`` triples of the strided evaluation of ``n_tokens`` tokens.

    Window ``[begin, end)`` is fed to the model and scores the tokens ``first_scored .. end - 1``
    (each predicted from the logits one position earlier). Token 0 is never scored: nothing
    predicts it.
    """
    _check_window(window, stride)
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score one, got {n_tokens}")
    out = []
    scored_up_to = 1  # the next token to score
    end = 0
    while scored_up_to < n_tokens:
        end = min(end + (window if not out else stride), n_tokens)
        begin = max(0, end - window)
        out.append((begin, end, scored_up_to))
        scored_up_to = end
    return out


def _check_window(window, stride) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an int >= 2 (one token of context, one to score), got {window!r}")
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= window - 1:
        raise ValueError(f"stride must be an int in [1, window - 1 = {window - 1}] (each scored token needs "
                         f"the token before it inside the window), got {stride!r}")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


#: rows of logits per cross-entropy call (the log-softmax temporary is rows x V floats)
_CE_ROWS = 128


@torch.no_grad()
def token_nlls(model, ids, *, window: int = 512, stride: int = 256, max_batch_tokens: int = 2048) -> torch.Tensor:
    """Negative log-likelihood (nats, float64) of tokens ``1 .. N-1`` of ``ids``, shape ``(N-1,)``.

    ``model(ids (B, T))`` returns logits ``(B, T, V)`` (or an object with ``.logits``). Windows
    are run in batches of at most ``max_batch_tokens`` tokens (the logits of a batch take
    ``4 * tokens * V`` bytes: 400 MB for 2048 tokens of a 49,152-token vocabulary).
    """
    if not isinstance(ids, torch.Tensor):
        ids = torch.tensor(list(ids), dtype=torch.long)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise ValueError(f"ids must be one sequence of token ids (1-D), got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids must be integer token ids, got {ids.dtype}")
    _check_window(window, stride)
    if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be a positive int, got {max_batch_tokens!r}")
    ids = ids.long()
    n = ids.shape[0]
    spans = windows(n, window, stride)
    nll = torch.empty(n - 1, dtype=torch.float64)
    # every window has the same length (min(window, n)), so they stack into batches
    per_batch = max(1, max_batch_tokens // min(window, n))
    device = getattr(model, "device", ids.device)
    for i in range(0, len(spans), per_batch):
        group = spans[i:i + per_batch]
        batch = torch.stack([ids[b:e] for b, e, _ in group]).to(device)
        logits = _logits(model, batch)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()        # the log-softmax in at least float32
        for row, (b, e, first) in enumerate(group):
            # logits at position p predict token p + 1: rows first-1 .. e-2 predict first .. e-1
            pred = logits[row, first - 1 - b:e - 1 - b]
            target = batch[row, first - b:e - b]
            # in slices of rows: the log-softmax of a whole window would be another (T, V) tensor
            for j in range(0, pred.shape[0], _CE_ROWS):
                rows = slice(first - 1 + j, min(first - 1 + j + _CE_ROWS, e - 1))
                nll[rows] = F.cross_entropy(pred[j:j + _CE_ROWS], target[j:j + _CE_ROWS],
                                            reduction="none").double().cpu()
    return nll


def perplexity(model, ids, *, window: int = 512, stride: int = 256, max_batch_tokens: int = 2048) -> float:
    """Token-level perplexity of ``model`` on ``ids`` (one sequence) with the strided evaluation.

    >>> perplexity(model, tokenizer.encode(text), window=512, stride=256)   # doctest: +SKIP
    """
    nll = token_nlls(model, ids, window=window, stride=stride, max_batch_tokens=max_batch_tokens)
    return math.exp(nll.mean().item())
