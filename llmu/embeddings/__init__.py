"""Module 01 — embeddings: cosine similarity, nearest neighbours, PCA; a Triton similarity kernel."""

from llmu.embeddings.kernels import cosine_similarity, top_k_neighbours
from llmu.embeddings.reference import PCA, cosine_similarity_matrix, pca, top_k_neighbours as top_k_neighbours_reference

__all__ = [
    "cosine_similarity",
    "top_k_neighbours",
    "cosine_similarity_matrix",
    "top_k_neighbours_reference",
    "pca",
    "PCA",
]
