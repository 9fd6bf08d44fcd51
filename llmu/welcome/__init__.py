"""Module 00 — welcome: a first Triton kernel (vector add) and a row-wise softmax."""

from llmu.welcome.kernels import add, softmax
from llmu.welcome.reference import naive_softmax, stable_softmax

__all__ = ["add", "softmax", "naive_softmax", "stable_softmax"]
