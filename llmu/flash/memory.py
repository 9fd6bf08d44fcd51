"""Peak memory of a PyTorch computation on any device, CPU included.

``torch.cuda.max_memory_allocated`` exists only on a GPU. :func:`peak_bytes` instead watches every
tensor the computation creates (through a ``TorchDispatchMode``, which sees each op's outputs),
adds up the bytes of the storages alive at each moment, and returns the largest total: the extra
memory the call needed beyond its inputs. A storage is counted once however many views share it,
and leaves the count when the last tensor using it is garbage-collected.

It is what the notebook uses to show that naive attention's memory grows as N² (the score and
probability matrices) and the tiled algorithm's as N (the inputs' float32 copies, the output and
one tile of scores).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["peak_bytes", "LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """A context manager that counts the bytes of tensor storage created inside it; ``.peak`` is
    the largest total alive at one time.

    ``exclude``: tensors that exist already (a call's inputs). Their storages count as zero bytes,
    so that a view of one (a transpose, a slice, autograd's saved alias) is not mistaken for new
    memory.
    """

    def __init__(self, exclude=()):
        super().__init__()
        self.refs: dict[int, list] = {}      # storage address -> [bytes, number of live tensors]
        self.current = 0
        self.peak = 0
        for t in exclude:                    # one reference that is never released: always 0 bytes
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != 0:
                self.refs[t.untyped_storage().data_ptr()] = [0, 1]

    def _release(self, key):
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key == 0:
                    continue
                if key in self.refs:
                    self.refs[key][1] += 1
                else:
                    self.refs[key] = [storage.nbytes(), 1]
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                weakref.finalize(t, self._release, key)
        return out


def peak_bytes(fn, *args, **kwargs) -> tuple[object, int]:
    """Run ``fn(*args, **kwargs)`` and return ``(result, peak)``: the most bytes of tensors created
    by the call that were alive at the same time (the inputs, and views of them, are not counted)."""
    tracker = LiveBytes(exclude=tree_flatten((args, kwargs))[0])
    with tracker:
        result = fn(*args, **kwargs)
    return result, tracker.peak
