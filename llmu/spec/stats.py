"""Goodness of fit without scipy: is a histogram of samples distributed as a given distribution?

The course's exactness claims about speculative sampling are statistical ("the emitted tokens are
distributed as the target's"): tests and the notebook check them with Pearson's chi-square test.
:func:`chi2_sf` is the chi-square tail probability in closed form (integer degrees of freedom),
:func:`chi_square_pvalue` the test itself.
"""

from __future__ import annotations

import math

import torch

__all__ = ["chi2_sf", "chi_square_pvalue"]


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with ``df`` degrees of freedom: ``Q(df/2, x/2)`` in closed form."""
    if x <= 0:
        return 1.0
    h = x / 2
    if df % 2 == 0:                              # Q(m, h) = e^-h sum_{i<m} h^i / i!
        term = total = math.exp(-h)
        for i in range(1, df // 2):
            term *= h / i
            total += term
        return total
    # Q(m + 1/2, h) = erfc(sqrt h) + e^-h sum_{i=1..m} h^(i-1/2) / Gamma(i+1/2)
    total = math.erfc(math.sqrt(h))
    term = math.exp(-h) * math.sqrt(h) / math.gamma(1.5)
    for i in range(1, (df - 1) // 2 + 1):
        total += term
        term *= h / (i + 0.5)
    return total


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, *, pool_below: float = 0.0) -> float:
    """Pearson's goodness of fit of ``counts`` to ``probs`` (same shape, any). Cells of probability
    0 are left out of the statistic and of the degrees of freedom; a sample in one is impossible
    under the hypothesis: p-value 0. ``pool_below``: cells expecting fewer samples than this are
    pooled into one cell (the approximation needs about 5 per cell; a distribution with a long tail
    of rare outcomes gets its tail tested as one outcome)."""
    if not isinstance(counts, torch.Tensor) or not isinstance(probs, torch.Tensor) or counts.shape != probs.shape:
        raise ValueError(f"counts and probs must be tensors of one shape, got {getattr(counts, 'shape', counts)} "
                         f"and {getattr(probs, 'shape', probs)}")
    counts, probs = counts.double().flatten(), probs.double().flatten()
    zero = probs <= 0
    if counts[zero].sum() > 0:
        return 0.0
    n = counts.sum()
    counts, probs = counts[~zero], probs[~zero]
    expected = n * probs / probs.sum()
    rare = expected < pool_below
    if rare.any() and rare.sum() < len(rare):
        pooled_count, pooled_expected = counts[rare].sum(), expected[rare].sum()
        counts, expected = counts[~rare].clone(), expected[~rare].clone()
        if pooled_expected >= pool_below:  # the tail as one more cell
            counts = torch.cat([counts, pooled_count[None]])
            expected = torch.cat([expected, pooled_expected[None]])
        else:  # too small even pooled: into the smallest cell kept
            i = int(expected.argmin())
            counts[i] += pooled_count
            expected[i] += pooled_expected
    if expected.min() < 5:
        raise ValueError(f"too few samples for the chi-square approximation: a cell expects "
                         f"{float(expected.min()):.2f} < 5 (draw more samples, or merge rare cells)")
    stat = float(((counts - expected) ** 2 / expected).sum())
    return chi2_sf(stat, len(counts) - 1)
