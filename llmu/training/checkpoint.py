"""Checkpoints for a hand-written training loop: save everything the next step depends on.

A run that stops (a crash, a preempted machine, the end of a time slot) must be able to continue
as if it never had. The next optimizer step depends on

- the **weights** (``model.state_dict()``);
- the **optimizer state**: AdamW's ``m``, ``v`` and step counts (``optimizer.state_dict()``).
  Left out, Adam restarts with ``m = v = 0`` and bias corrections of step 1: its next steps are
  full-size steps in the direction of one noisy gradient, a visible bump in the loss;
- the **iteration** number, which the learning-rate schedule is a function of;
- and, for an *exact* continuation, the random state the data order comes from: the generator
  that ``llmu.training.batches.get_batch`` draws start positions with, a scheduler, a sampler.
  These go in ``extra``, a mapping of names to objects with ``state_dict()``/``load_state_dict()``
  (or a ``torch.Generator``, saved with ``get_state()``).

``save_checkpoint(model, optimizer, iteration, out)`` writes them with ``torch.save`` to ``out``,
a path or a binary file object (an ``io.BytesIO``, an open file). A path is written beside its
destination first and then renamed over it (``os.replace`` is atomic): a crash mid-write leaves the
previous checkpoint whole. ``load_checkpoint(src, model, optimizer)`` restores them in place and
returns the iteration. It loads with ``weights_only=True``: a checkpoint is data, and unpickling
arbitrary objects from a file would run whatever code the file names.

``llmu.training.loop.Trainer``'s ``save_checkpoint``/``load_checkpoint`` methods store the same
things plus its config and history, in a layout of their own, written and read by the same
:func:`write_state` and :func:`read_state`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from llmu.checks import require_int

__all__ = ["save_checkpoint", "load_checkpoint", "write_state", "read_state"]


def _check_parts(model, optimizer) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def _check_extra(extra) -> Mapping:
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a mapping of names to objects with state_dict(), got {type(extra).__name__}")
    for name, obj in extra.items():
        if not isinstance(name, str):
            raise TypeError(f"extra's keys must be str, got {name!r}")
        if not (isinstance(obj, torch.Generator) or (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))):
            raise TypeError(f"extra[{name!r}] must be a torch.Generator or have state_dict()/load_state_dict(), "
                            f"got {type(obj).__name__}")
    return extra


def _is_path(x) -> bool:
    return isinstance(x, (str, os.PathLike))


def write_state(state: dict, out) -> None:
    """``torch.save(state)`` to ``out``: a path, written beside it and renamed over it (``os.replace``
    is atomic: a crash mid-write leaves the previous file whole), or a binary file object."""
    if _is_path(out):
        path = os.fspath(out)
        partial = path + ".partial"
        torch.save(state, partial)
        os.replace(partial, path)                 # atomic: readers see the old file or the new one
    elif hasattr(out, "write"):
        torch.save(state, out)
    else:
        raise TypeError(f"out must be a path (str or os.PathLike) or a binary file object, got {type(out).__name__}")


def read_state(src) -> dict:
    """What :func:`write_state` wrote, from a path or a binary file object, on the CPU, with
    ``weights_only=True`` (a checkpoint is data: nothing in it is run)."""
    if not (_is_path(src) or hasattr(src, "read")):
        raise TypeError(f"src must be a path (str or os.PathLike) or a binary file object, got {type(src).__name__}")
    return torch.load(os.fspath(src) if _is_path(src) else src, map_location="cpu", weights_only=True)


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, iteration: int, out, *,
                    extra: Mapping | None = None) -> None:
    """Write ``model``'s weights, ``optimizer``'s state, ``iteration`` and the state of each object
    of ``extra`` to ``out`` (a path, written atomically, or a binary file object)."""
    _check_parts(model, optimizer)
    iteration = require_int("iteration", iteration, 0)
    extra = _check_extra(extra)
    state = {
        "iteration": iteration,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "extra": {name: obj.get_state() if isinstance(obj, torch.Generator) else obj.state_dict()
                  for name, obj in extra.items()},
    }
    write_state(state, out)


def load_checkpoint(src, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                    extra: Mapping | None = None) -> int:
    """Restore a :func:`save_checkpoint` file from ``src`` (a path or a binary file object) into
    ``model``, ``optimizer`` and the objects of ``extra`` (the names they were saved under);
    return the saved iteration."""
    _check_parts(model, optimizer)
    extra = _check_extra(extra)
    state = read_state(src)
    missing = sorted(set(extra) - set(state["extra"]))
    if missing:
        raise KeyError(f"the checkpoint holds no state for extra {missing} (it has {sorted(state['extra'])})")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])   # moves the state to each parameter's device
    for name, obj in extra.items():
        if isinstance(obj, torch.Generator):
            obj.set_state(state["extra"][name])
        else:
            obj.load_state_dict(state["extra"][name])
    return int(state["iteration"])
