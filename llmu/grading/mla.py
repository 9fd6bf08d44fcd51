"""How notebook 07 grades the learner's MLA module (exercise 5): what its cache holds, and which
tensors its decode step makes.

The learner designs the cache object (a tuple, a dataclass, a dict ...), so the grader reads it
without knowing its structure:

- :func:`tensors_in` finds every tensor an object holds (in tuples, lists, dicts, sets and the
  attributes of plain objects, at any depth; an ``nn.Module`` inside is not searched, so a cache
  that points back at its layer is not charged for the layer's weights), each tensor once;
- :func:`cache_numel` adds up their numbers: for MLA, ``B * T * (d_c + d_r)``.

The decode step must never build a key or a value per head. :class:`OpShapes` (a
``TorchFunctionMode``) records the shape of every tensor that a torch function or tensor method
(``@``, ``einsum``, ``view``, ``F.linear`` ...) returns inside it, views included, and
:func:`per_head_tensors` picks out those that can only be per-head keys or
values over the cached positions: a shape with a dimension counting positions and one of
``d_h`` or ``H d_h`` numbers, or a dimension that is one of their products (a flattened copy).
A ``TorchFunctionMode`` sees the calls the code makes, not the kernels they run, which is what
matters here (a per-head key is the result of some call), and it costs nothing to enter (a
``TorchDispatchMode`` imports ``torch._dynamo`` on first use, seconds on a laptop). The check is
only meaningful at sizes where no other tensor of the step shares those
dimensions: the grader chooses them so (batch 1, sizes that are pairwise different).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["tensors_in", "cache_numel", "OpShapes", "op_shapes", "per_head_tensors"]


def tensors_in(obj, *, max_depth: int = 16) -> list[torch.Tensor]:
    """Every tensor ``obj`` holds, each once (by identity), in the order found."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(o, depth):
        if isinstance(o, torch.Tensor):
            found.setdefault(id(o), o)
            return
        if depth > max_depth or id(o) in seen or isinstance(o, (nn.Module, str, bytes, int, float, complex, type)):
            return
        seen.add(id(o))
        if isinstance(o, dict):
            items = o.values()
        elif isinstance(o, (list, tuple, set, frozenset)):
            items = o
        elif hasattr(o, "__dict__") or hasattr(o, "__slots__"):
            items = list(vars(o).values()) if hasattr(o, "__dict__") else []
            items += [getattr(o, s) for s in getattr(type(o), "__slots__", ()) if hasattr(o, s)]
        else:
            return
        for item in items:
            walk(item, depth + 1)

    walk(obj, 0)
    return list(found.values())


def cache_numel(cache) -> int:
    """How many numbers the tensors of ``cache`` hold (see :func:`tensors_in`)."""
    return sum(t.numel() for t in tensors_in(cache))


class OpShapes(TorchFunctionMode):
    """A context manager that records ``(function name, output shape)`` for every tensor a torch
    function or tensor method returns inside it (views, tuples of tensors and in-place results
    included); ``.shapes`` is the list. Calls made inside a recorded call are not seen: the
    recorded call's own result is."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", None) or str(func)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.shapes.append((name, tuple(t.shape)))
        return out


def op_shapes(fn, *args, **kwargs) -> tuple[object, list[tuple[str, tuple[int, ...]]]]:
    """Run ``fn(*args, **kwargs)`` under :class:`OpShapes`: ``(result, shapes)``."""
    with OpShapes() as rec:
        result = fn(*args, **kwargs)
    return result, rec.shapes


def per_head_tensors(shapes, *, positions, n_heads: int, head_dim: int) -> list[tuple[str, tuple[int, ...]]]:
    """The recorded ``(op, shape)`` pairs that look like keys or values of ``head_dim`` numbers per
    head over the cached ``positions`` (an int or several: the cache's length before and after
    the step): a shape with a dimension in ``positions`` (or ``n_heads`` times one) and another of
    ``head_dim`` or ``n_heads * head_dim``, or a dimension equal to one of their products."""
    for name, value in (("n_heads", n_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    positions = {positions} if isinstance(positions, int) else set(positions)
    if not positions or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in positions):
        raise ValueError(f"positions must be positive ints, got {sorted(positions)!r}")
    rows = positions | {n_heads * p for p in positions}
    widths = {head_dim, n_heads * head_dim}
    flat = {r * w for r in positions for w in widths}
    flagged = []
    for op, shape in shapes:
        dims = list(shape)
        has_rows = [i for i, d in enumerate(dims) if d in rows]
        has_width = [i for i, d in enumerate(dims) if d in widths]
        if any(i != j for i in has_rows for j in has_width) or any(d in flat for d in dims):
            flagged.append((op, shape))
    return flagged
