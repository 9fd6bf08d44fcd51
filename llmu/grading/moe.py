"""Checks for notebook 12's exercise 6, the learner's MoE layer, that do not depend on how it is built.

The learner designs ``MyMoELayer``: how it holds the weights (transposed, fused, in an
``nn.Linear`` or not) and how it groups the token copies by expert. The grader checks behaviour
only, with two helpers that do not depend on those choices:

- :func:`sorted_values` puts every number of a list of tensors in one sorted vector: the
  parameters of a module hold exactly the numbers it was loaded with (in any layout) when their
  sorted values equal those of the loaded tensors, and the same holds for their gradients. Sorting
  is 1-Lipschitz in the largest difference, so two sets of numbers that match within ``atol`` in
  some order also match within ``atol`` once both are sorted;
- :func:`notebook_lines` counts the lines of the learner's own code (functions defined in the
  notebook's namespace, helpers included) that one call runs, with ``sys.settrace``. A layer that
  loops over the ``E`` experts runs as many lines for 32 tokens as for 288; one that loops over the
  tokens or the token copies in Python, with torch operations or on plain lists, runs at least one
  more line per token. Library code (torch, llmu) is not counted.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable

import torch

__all__ = ["sorted_values", "notebook_lines"]


def sorted_values(tensors: Iterable[torch.Tensor | None], like: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
    """Every number of ``tensors``, flattened, concatenated, as float64 on the CPU, sorted.

    A ``None`` in ``tensors`` (a parameter that received no gradient) stands for zeros of the size
    of the matching tensor of ``like`` (the parameters themselves); without ``like`` it raises
    ``ValueError``. An empty list gives an empty vector.
    """
    tensors = list(tensors)
    like = list(like) if like is not None else None
    if like is not None and len(like) != len(tensors):
        raise ValueError(f"like must hold one tensor per entry of tensors ({len(tensors)}), got {len(like)}")
    parts = []
    for i, t in enumerate(tensors):
        if t is None:
            if like is None:
                raise ValueError(f"tensors[{i}] is None: pass like= (the parameters) to count it as zeros")
            t = torch.zeros(like[i].numel())
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor or None, got {type(t).__name__}")
        parts.append(t.detach().reshape(-1).to("cpu", torch.float64))
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat(parts).sort().values


def _home_globals(home) -> dict:
    """The namespace ``home`` (a function, or a class with methods) was defined in."""
    fn = home.__func__ if isinstance(home, types.MethodType) else home
    if isinstance(fn, types.FunctionType):
        return fn.__globals__
    if isinstance(fn, type):
        for cls in fn.__mro__:
            for value in vars(cls).values():
                value = getattr(value, "__func__", value)
                if isinstance(value, types.FunctionType):
                    return value.__globals__
    raise TypeError(f"home must be a function or a class with methods, got {type(home).__name__}")


def notebook_lines(call, home) -> tuple[object, int]:
    """Run ``call()`` and count the lines it runs in code defined where ``home`` was (the namespace
    of the learner's class or function: the notebook's, with its helpers and earlier answers).
    Returns ``(call's result, lines run)``. A loop body counts once per iteration; comprehensions
    and generator expressions count per item. The tracer in place before (a debugger, coverage) is
    put back afterwards."""
    if not callable(call):
        raise TypeError(f"call must be a callable taking no arguments, got {type(call).__name__}")
    home_globals = _home_globals(home)
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def trace(frame, event, arg):
        return local if frame.f_globals is home_globals else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        result = call()
    finally:
        sys.settrace(previous)
    return result, count
