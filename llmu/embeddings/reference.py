"""Torch references for module 01: cosine similarity, nearest neighbours, and a 2-D PCA.

These are the definitions the Triton kernel in ``kernels.py`` is tested against, and what the
notebook uses to explore SmolLM2's embedding table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmu.checks import require_positive

__all__ = ["cosine_similarity_matrix", "top_k_neighbours", "exclusion_mask", "pca", "PCA", "DEFAULT_EPS"]

#: Norms below this are clamped to it, as in ``torch.nn.functional.cosine_similarity``.
DEFAULT_EPS = 1e-8


def _check_rows(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D matrix of row vectors, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x


def cosine_similarity_matrix(a: torch.Tensor, b: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """``S[i, j] = cos(a_i, b_j)`` for row sets ``a`` (Q, D) and ``b`` (V, D); returns (Q, V).

    .. math:: \\cos(a, b) = \\frac{a}{\\max(\\lVert a \\rVert, \\epsilon)} \\cdot
              \\frac{b}{\\max(\\lVert b \\rVert, \\epsilon)}

    Each norm is clamped to ``eps`` separately, exactly as ``F.cosine_similarity`` does, so a zero
    vector has similarity 0 with everything (itself included) instead of NaN. Computed in float32,
    returned in the dtype of ``a``.
    """
    _check_rows("a", a)
    _check_rows("b", b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a and b must have the same row length, got {a.shape[1]} and {b.shape[1]}")
    require_positive("eps", eps)
    af, bf = a.float(), b.float()
    a_unit = af / af.norm(dim=1, keepdim=True).clamp_min(eps)
    b_unit = bf / bf.norm(dim=1, keepdim=True).clamp_min(eps)
    return (a_unit @ b_unit.T).to(a.dtype)


def exclusion_mask(scores: torch.Tensor, exclude: torch.Tensor | None) -> torch.Tensor:
    """``scores`` with ``scores[i, exclude[i]]`` set to ``-inf`` (a copy); ``exclude=None`` is a no-op.

    ``exclude`` holds one column index per row, typically the query's own id when the queries are
    rows of the table: a word is always its own nearest neighbour.
    """
    if exclude is None:
        return scores
    if not isinstance(exclude, torch.Tensor) or exclude.dtype not in (torch.int32, torch.int64):
        raise TypeError("exclude must be an integer tensor of column indices, one per query")
    if exclude.shape != (scores.shape[0],):
        raise ValueError(f"exclude must have shape ({scores.shape[0]},) (one index per query), got {tuple(exclude.shape)}")
    if exclude.numel() and (exclude.min() < 0 or exclude.max() >= scores.shape[1]):
        raise ValueError(f"exclude indices must lie in [0, {scores.shape[1]}), got {exclude.min()}..{exclude.max()}")
    out = scores.clone()
    out[torch.arange(scores.shape[0], device=scores.device), exclude.to(scores.device).long()] = -float("inf")
    return out


def _check_k(k, n_candidates: int, excluded: bool) -> None:
    require_positive("k", k, integer=True)
    available = n_candidates - (1 if excluded else 0)
    if k > available:
        extra = " after excluding each query's own row" if excluded else ""
        raise ValueError(f"k={k} is larger than the {available} candidate rows{extra}")


def top_k_neighbours(
    queries: torch.Tensor,
    table: torch.Tensor,
    k: int,
    exclude: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` rows of ``table`` most cosine-similar to each query: ``(scores, indices)``, each (Q, k).

    Sorted from most to least similar. ``exclude`` (optional, shape (Q,)) names one table row per
    query to leave out. ``k`` larger than the number of candidates raises ``ValueError``.
    """
    _check_rows("table", table)
    _check_k(k, table.shape[0], exclude is not None)
    return top_k_of(cosine_similarity_matrix(queries, table, eps=eps), k, exclude)


def top_k_of(scores: torch.Tensor, k: int, exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of a (Q, V) similarity matrix, as float32
    ``(scores, indices)`` sorted from most to least similar, after leaving out ``exclude``."""
    top = torch.topk(exclusion_mask(scores.float(), exclude), k, dim=1, largest=True, sorted=True)
    return top.values, top.indices


@dataclass(frozen=True)
class PCA:
    """The result of :func:`pca`: ``coords`` (N, k) are the centred points in the basis
    ``components`` (k, D); ``explained`` (k,) is the fraction of the total variance along each."""

    coords: torch.Tensor
    components: torch.Tensor
    mean: torch.Tensor
    explained: torch.Tensor

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Coordinates of new points ``x`` (M, D) in the same basis."""
        return (x.float() - self.mean) @ self.components.T


def pca(x: torch.Tensor, k: int = 2) -> PCA:
    """Principal component analysis of the rows of ``x`` (N, D) through ``torch.linalg.svd``.

    Centre the rows, take the SVD ``X - mean = U S V^T``; the first ``k`` rows of ``V^T`` are the
    directions of largest variance and ``U[:, :k] * S[:k]`` the coordinates along them. The sign of
    each component is fixed so that its largest-magnitude entry is positive (SVD leaves it free).
    """
    _check_rows("x", x)
    require_positive("k", k, integer=True)
    n, d = x.shape
    if k > min(n, d):
        raise ValueError(f"k={k} components need at least k rows and k columns, got x of shape {(n, d)}")
    xf = x.float()
    mean = xf.mean(dim=0)
    centred = xf - mean
    u, s, vt = torch.linalg.svd(centred, full_matrices=False)
    comps = vt[:k]
    signs = torch.sign(comps.gather(1, comps.abs().argmax(dim=1, keepdim=True)))
    signs[signs == 0] = 1
    comps = comps * signs
    coords = (u[:, :k] * s[:k]) * signs.T
    total = (s**2).sum()
    explained = (s[:k] ** 2) / total if total > 0 else torch.zeros(k)
    return PCA(coords=coords, components=comps, mean=mean, explained=explained)
