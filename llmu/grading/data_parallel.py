"""The grader's run of a learner's data-parallel strategy on real processes (notebook 14, exercise 5).

The learner writes four strategies in a ``%%module`` cell (:mod:`llmu.cell_module`), a ``.py``
file the ranks can import. :func:`trial` is what each rank runs, under
``llmu.distributed.launch(trial, 2, path, name, strategy)``:

1. it imports the learner's module from its file;
2. it records every collective the strategy calls (``torch.distributed``'s functions are wrapped
   for the run: which one, how many elements, asynchronous or not, and in which phase of the
   step it was launched: while the strategy was being built, inside ``loss.backward()``, or after);
3. it trains a tiny Llama for a few AdamW steps with the strategy, this rank on its shard of the
   batch, and beside it the single-process reference, :func:`llmu.parallel.data_parallel.accumulated_steps`
   (one process accumulating the ranks' micro-batches in rank order, then dividing by ``W``);
4. it returns the parameters after every step, the reference's, the recorded calls, and the
   elements its optimizer states hold.

The protocol of each strategy (what the notebook's exercise text states)::

    "naive"      loss.backward(); my.all_reduce_gradients(model); opt.step(); opt.zero_grad()
    "overlapped" dp = my.OverlappedDP(model); per step: loss.backward(); dp.finish(); opt.step(); ...
    "bucketed"   dp = my.BucketedDP(model, bucket_mb); per step: as "overlapped"
    "zero1"      opt = my.ZeRO1(model.parameters(), torch.optim.AdamW, lr=lr);
                 per step: loss.backward(); opt.step(); opt.zero_grad()

Why the comparison can be exact (``torch.equal``) on two ranks: a rank's gradient is computed by
the same kernels, on the same micro-batch, with the same one thread, as the reference's backward
of that micro-batch; the sum of two ranks is ``g0 + g1`` whichever rank adds (addition commutes
exactly); the reference accumulates the same ``g0 + g1``; and dividing by 2 is exact. On three or
more ranks a ring adds the chunks in an order that depends on the chunk, ``(g1 + g2) + g0`` for
one, ``(g2 + g0) + g1`` for another, and the last bits differ from the reference's
``(g0 + g1) + g2`` (see :mod:`llmu.parallel.ordered_reduce`): there, only a tolerance holds.
For the overlapped and bucketed strategies, rank 1 starts from other weights than rank 0 (another
seed): the strategy must broadcast rank 0's at construction, as DDP does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys

import torch
import torch.distributed as dist

__all__ = ["STRATEGIES", "trial", "expected_buckets", "optimizer_state_numel"]

#: The strategies :func:`trial` runs, in the exercise's order.
STRATEGIES = ("naive", "overlapped", "bucketed", "zero1")

# The collectives a strategy may call, recorded by name (older and newer spellings)
_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather",
                "broadcast", "reduce", "all_to_all_single", "all_to_all", "reduce_scatter_single",
                "all_gather_single", "gather", "scatter", "send", "recv", "isend", "irecv", "barrier")


class _Recorder:
    """Wraps ``torch.distributed``'s collectives for the run and records each call."""

    def __init__(self):
        self.phase, self.step, self.calls = "build", 0, []

    @contextlib.contextmanager
    def recording(self):
        saved = {}
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            saved[name] = fn

            def wrapper(*args, _fn=fn, _name=name, **kwargs):
                # the size of the whole buffer: the largest tensor passed (an all-gather's output,
                # a reduce-scatter's input), or the sum of a list of per-rank pieces
                values = (*args, *kwargs.values())
                sizes = [a.numel() for a in values if isinstance(a, torch.Tensor)]
                sizes += [sum(t.numel() for t in a if isinstance(t, torch.Tensor)) for a in values
                          if isinstance(a, (list, tuple))]
                self.calls.append({"op": _name, "numel": int(max(sizes, default=0)),
                                   "async": bool(kwargs.get("async_op", False)), "phase": self.phase, "step": self.step})
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)


def _import(path: str, name: str):
    """The learner's module, imported from its file as ``name`` (what the notebook imported)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot import {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def optimizer_state_numel(obj) -> int:
    """Elements held in the states of the ``torch.optim`` optimizers found in ``obj`` (itself, its
    attributes, and lists, tuples or dicts of them, one level down)."""
    found, seen = [], set()

    def visit(x, depth):
        if id(x) in seen or depth > 2:
            return
        seen.add(id(x))
        if isinstance(x, torch.optim.Optimizer):
            found.append(x)
        if isinstance(x, (list, tuple)):
            for y in x:
                visit(y, depth + 1)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y, depth + 1)
        elif hasattr(x, "__dict__") and not isinstance(x, (torch.Tensor, torch.nn.Module)):
            for y in vars(x).values():
                visit(y, depth + 1)

    visit(obj, 0)
    return sum(t.numel() for opt in found for state in opt.state.values()
               for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def expected_buckets(model: torch.nn.Module, bucket_mb: float) -> list[int]:
    """Elements per bucket under the exercise's rule: parameters in reverse order, a bucket closed
    once it holds at least ``bucket_mb`` MiB, the rule of :class:`llmu.parallel.data_parallel.DataParallel`."""
    from llmu.parallel.data_parallel import _bucket_bytes, _make_buckets

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [b.flat.numel() for b in _make_buckets(named[::-1], _bucket_bytes(bucket_mb))]


def trial(rank: int, world_size: int, path: str, name: str, strategy: str, steps: int = 3, seed: int = 0,
          batch_per_rank: int = 2, seq: int = 17, lr: float = 1e-2, bucket_mb: float = 0.05) -> dict:
    """Train with the learner's ``strategy`` from module ``name`` at ``path``; see the module's text."""
    from llmu.models import tiny_llama
    from llmu.parallel.data_parallel import accumulated_steps, next_token_loss

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")

    def fresh(s):
        return tiny_llama(s).train().requires_grad_(True)

    vocab = fresh(seed).config.vocab_size
    ids = torch.randint(vocab, (world_size * batch_per_rank, seq), generator=torch.Generator().manual_seed(seed + 1))
    shards = list(ids.split(batch_per_rank))
    reference = accumulated_steps(fresh(seed), shards, steps, lr)

    # overlapped and bucketed start from different weights on each rank: they must broadcast rank 0's
    model = fresh(seed + (rank if strategy in ("overlapped", "bucketed") else 0))
    recorder = _Recorder()
    params, state = [], 0
    with recorder.recording():
        # imported while recording: a `from torch.distributed import all_reduce` gets the recorded one
        own = _import(path, name)
        if strategy == "zero1":
            opt = own.ZeRO1(model.parameters(), torch.optim.AdamW, lr=lr)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
            dp = {"naive": None, "overlapped": lambda: own.OverlappedDP(model),
                  "bucketed": lambda: own.BucketedDP(model, bucket_mb)}[strategy]
            dp = dp() if dp else None
        for step in range(steps):
            recorder.step = step
            recorder.phase = "forward"
            loss = next_token_loss(model, shards[rank])
            recorder.phase = "backward"
            loss.backward()
            recorder.phase = "after"
            if strategy == "naive":
                own.all_reduce_gradients(model)
            elif strategy in ("overlapped", "bucketed"):
                dp.finish()
            opt.step()
            opt.zero_grad()
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        state = optimizer_state_numel(opt)
    return {"params": params, "reference": reference, "calls": recorder.calls, "state_numel": state,
            "num_params": sum(p.numel() for p in model.parameters()),
            "buckets": expected_buckets(model, bucket_mb), "steps": steps}
