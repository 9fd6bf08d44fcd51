"""Data parallelism written out: what ``torch.nn.parallel.DistributedDataParallel`` does.

Every one of ``W`` ranks holds a full copy of the model and its own shard of the batch. If the
copies start equal and every rank applies the same update, they stay equal, and the update is the
single-process one as long as every rank uses the gradient of the **whole** batch. With a loss that
is a mean over equal shards, that gradient is the average of the ranks' gradients:

    g = (1/B) sum_batch grad l_i = (1/W) sum_r (W/B) sum_{shard r} grad l_i = (1/W) sum_r g_r

so data parallelism is: (1) broadcast the parameters from rank 0 once, at construction; (2) after
every backward, all-reduce the gradients and divide by ``W``; (3) let each rank's optimizer step.

The art is in (2). A naive version waits for the backward to finish and then all-reduces every
gradient, one collective per tensor: the network idles during the backward, and the computation
idles during the communication, and hundreds of small messages each pay the latency. DDP fixes both:

- **Buckets.** Gradients are packed into flat buffers of about ``bucket_mb`` MiB, one all-reduce
  per buffer: few large messages instead of many small ones.
- **Overlap.** The backward produces gradients in roughly the reverse order of the parameters
  (the last layer's first), so the buckets are filled in that order. A hook on every parameter
  (``register_post_accumulate_grad_hook``, which fires once the gradient is accumulated into
  ``p.grad``) counts the gradients of its bucket; when the bucket is complete, its all-reduce is
  launched **asynchronously** and the backward goes on computing the earlier layers' gradients
  while the bytes travel.
- **Order.** Every rank must launch the same collectives in the same order, or they pair up
  wrongly. A bucket is launched only after all the buckets before it: bucket ``k`` waits for
  bucket ``k - 1`` even if its own gradients came first.

:meth:`DataParallel.finish` (call it after ``backward`` and before ``optimizer.step``) launches any
bucket still missing (a parameter that got no gradient, unused in this forward, counts as zero,
as DDP's ``find_unused_parameters`` does), waits for every all-reduce, divides by ``W`` and writes
the averages back into ``p.grad``. :meth:`DataParallel.no_sync` skips the communication for
gradient accumulation: backward passes inside it only add into ``p.grad``, and the next backward
outside it all-reduces the sum.

:attr:`DataParallel.timeline` records, for the last step, when the forward ended, when the
backward started and ended, when each bucket was launched and when its all-reduce completed (a
callback on the collective's future), all in seconds from the start of the forward: the picture
of the overlap.

Averaging is a sum followed by a division by ``W``. With ``W`` a power of two (2, 4, 8) the
division is exact in floating point, so whether one divides before or after the sum changes
nothing; the only differences from the single process come from summing the batch in another
grouping (per rank, then across ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["all_reduce_gradients", "DataParallel", "Bucket", "require_process_group", "broadcast_module", "next_token_loss", "single_process_steps",
           "accumulated_steps", "tensors_in", "demo"]


# ----------------------------------------------------------------------------------------------
# Helpers shared with zero.py
# ----------------------------------------------------------------------------------------------


def require_process_group(group=None, what: str = "data parallelism") -> tuple[int, int]:
    """``(world_size, rank)`` in ``group``, or a clear error outside a process group."""
    if not dist.is_initialized():
        raise RuntimeError(f"{what} needs a process group: run it inside llmu.distributed.launch "
                           "(or after torch.distributed.init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


def broadcast_module(module: nn.Module, group=None) -> None:
    """Copy rank 0's parameters and buffers to every rank of ``group`` (in place)."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors inside a module's output: a tensor, or tuples, lists, dicts and dataclasses of them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors_in(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in tensors_in(item)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name))]
    return []


def next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``ids[:, 1:]`` from ``ids[:, :-1]`` (a language model's
    training loss). ``model`` returns logits, or an object with a ``logits`` field."""
    out = model(ids[:, :-1])
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _bucket_bytes(bucket_mb) -> int:
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
        raise TypeError(f"bucket_mb must be a number of MiB, got {type(bucket_mb).__name__}")
    if not (bucket_mb > 0 and math.isfinite(bucket_mb)):
        raise ValueError(f"bucket_mb must be a positive, finite number of MiB, got {bucket_mb!r}")
    return max(1, int(bucket_mb * 2**20))


# ----------------------------------------------------------------------------------------------
# The naive version
# ----------------------------------------------------------------------------------------------


def all_reduce_gradients(module: nn.Module, group=None) -> None:
    """Data parallelism at its simplest: after ``backward``, replace every gradient by its average
    over the ranks, one blocking all-reduce per parameter. Nothing overlaps: the network waits for
    the whole backward, then the computation waits for the network. A parameter without a
    gradient (unused in this forward) gets the average of zeros and the other ranks' gradients,
    as :class:`DataParallel` gives it."""
    world_size, _ = require_process_group(group)
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(world_size)


# ----------------------------------------------------------------------------------------------
# Buckets
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Bucket:
    """Parameters whose gradients travel in one all-reduce, packed into ``flat`` at ``offsets``."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    ready: int = 0                      # gradients accumulated in this backward
    work: object = None                 # the async all-reduce, once launched
    launched_at: float | None = None    # seconds from the forward's start
    done_at: float | None = None

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def _make_buckets(named_params: list[tuple[str, nn.Parameter]], bucket_bytes: int) -> list[Bucket]:
    """Greedy packing of the parameters, in the given order, into buckets of about ``bucket_bytes``
    (a bucket is closed once it reaches the size; one dtype per bucket)."""
    groups: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for name, p in named_params:
        if not groups or size >= bucket_bytes or groups[-1][0][1].dtype != p.dtype:
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += p.numel() * p.element_size()
    buckets = []
    for index, group in enumerate(groups):
        offsets, total = [], 0
        for _, p in group:
            offsets.append(total)
            total += p.numel()
        ref = group[0][1]
        flat = torch.zeros(total, dtype=ref.dtype, device=ref.device)
        buckets.append(Bucket(index, [n for n, _ in group], [p for _, p in group], offsets, flat))
    return buckets


# ----------------------------------------------------------------------------------------------
# The wrapper
# ----------------------------------------------------------------------------------------------


class DataParallel(nn.Module):
    """``module`` replicated on every rank of ``group``, gradients averaged in overlapped buckets.

    Build it on every rank at once (after ``init_process_group``, e.g. inside
    ``llmu.distributed.launch``): rank 0's parameters and buffers are broadcast to the others.
    Then, per step::

        loss = loss_fn(dp(my_shard))        # forward on this rank's shard of the batch
        loss.backward()                     # buckets are all-reduced while this runs
        dp.finish()                         # wait; p.grad now holds the average over the ranks
        optimizer.step(); optimizer.zero_grad()

    ``bucket_mb``: the bucket size in MiB (PyTorch's DDP uses 25). Parameters are bucketed in the
    reverse order of ``module.parameters()``, the order the backward produces their gradients.
    Only parameters with ``requires_grad`` are synchronised.
    """

    def __init__(self, module: nn.Module, *, bucket_mb: float = 25.0, group=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        bucket_bytes = _bucket_bytes(bucket_mb)
        self.world_size, self.rank = require_process_group(group)
        self.module, self.group, self.bucket_mb = module, group, bucket_mb

        # Step 1: every replica starts from rank 0's weights
        broadcast_module(module, group)

        # Step 2: buckets, in the order the backward produces the gradients (named_parameters
        # lists a shared parameter once)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("module has no parameter with requires_grad=True: nothing to synchronise "
                             "(call module.requires_grad_(True) to train it)")
        self.buckets = _make_buckets(named[::-1], bucket_bytes)
        self._where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}

        # Step 3: one hook per parameter
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for _, p in named]
        self._sync = True
        self._next_bucket = 0           # the first bucket not launched yet
        self._grads_seen = 0            # hooks fired in this (synchronised) backward
        self._t0 = time.perf_counter()
        self.timeline: dict = {}

    # -- the step ---------------------------------------------------------------------------------
    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def forward(self, *args, **kwargs):
        self._t0 = time.perf_counter()
        self.timeline = {"forward_start": 0.0, "forward_end": None, "backward_start": None,
                         "backward_end": None, "finish_end": None, "synchronised": self._sync}
        out = self.module(*args, **kwargs)
        self.timeline["forward_end"] = self._now()
        # the backward of the module starts when the gradient of its output arrives
        for t in tensors_in(out):
            if t.requires_grad:
                t.register_hook(self._backward_started)
        return out

    def _backward_started(self, grad):
        if self.timeline and self.timeline["backward_start"] is None:
            self.timeline["backward_start"] = self._now()

    def _grad_ready(self, p: torch.Tensor) -> None:
        """Hook: ``p.grad`` is complete for this backward. Launch every bucket that can go."""
        if not self._sync:
            return
        bucket, _ = self._where[p]
        bucket.ready += 1
        self._grads_seen += 1
        self._launch_ready_buckets()
        if self.timeline:
            self.timeline["backward_end"] = self._now()     # the last hook's end is the backward's

    def _launch_ready_buckets(self, force: bool = False) -> None:
        """Launch buckets in index order, each only once complete (all of them with ``force``)."""
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if not force and bucket.ready < len(bucket.params):
                return
            self._launch(bucket)
            self._next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        # pack the gradients (a parameter without one, unused in this forward, contributes zero)
        for p, off in zip(bucket.params, bucket.offsets):
            dst = bucket.flat[off:off + p.numel()]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(p.grad.reshape(-1))
        bucket.launched_at = self._now()
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
        bucket.work.get_future().add_done_callback(lambda _, b=bucket: setattr(b, "done_at", self._now()))

    def finish(self) -> None:
        """Wait for every bucket's all-reduce and write the average gradients into ``p.grad``.

        Call it on every rank after ``backward`` (outside :meth:`no_sync`) and before the
        optimizer step. Buckets not launched yet (parameters unused in this forward) go now.
        """
        if self._grads_seen == 0 and self._next_bucket == 0:
            raise RuntimeError("finish() needs a backward outside no_sync() first: no gradient has "
                               "been produced since the last finish()")
        self._launch_ready_buckets(force=True)
        for bucket in self.buckets:
            bucket.work.wait()
            if bucket.done_at is None:     # the completion callback may still be on its way
                bucket.done_at = self._now()
            bucket.flat.div_(self.world_size)
            for p, off in zip(bucket.params, bucket.offsets):
                avg = bucket.flat[off:off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)
            bucket.ready, bucket.work = 0, None
        self._next_bucket = self._grads_seen = 0
        if self.timeline:
            self.timeline["finish_end"] = self._now()
            self.timeline["buckets"] = [
                {"index": b.index, "params": list(b.names), "bytes": b.nbytes,
                 "launched_at": b.launched_at, "done_at": b.done_at} for b in self.buckets]

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block only accumulate into ``p.grad`` (no communication);
        the next backward outside it all-reduces the accumulated gradients."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the module's parameters (the wrapper stops working)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, rank={self.rank}, bucket_mb={self.bucket_mb}, "
                f"buckets={len(self.buckets)}")


# ----------------------------------------------------------------------------------------------
# For the notebook
# ----------------------------------------------------------------------------------------------


def _tiny_model(seed: int, **overrides) -> nn.Module:
    from llmu.models import tiny_llama

    return tiny_llama(seed, **overrides).train().requires_grad_(True)


def single_process_steps(model: nn.Module, ids: torch.Tensor, steps: int, lr: float):
    """The result every data-parallel strategy must reproduce: ``steps`` AdamW steps of ``model``
    on the whole batch ``ids`` in one process. Returns ``(grads, params)``: the gradients of the
    first step and the parameters after every step, each a dict by parameter name."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    grads, params = None, []
    for _ in range(steps):
        next_token_loss(model, ids).backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return grads, params


def accumulated_steps(model: nn.Module, micro_batches, steps: int, lr: float) -> list[dict]:
    """What sharded training reproduces bit for bit: ``steps`` AdamW steps of ``model`` in one
    process, each accumulating the gradients of ``micro_batches`` (one per rank) in rank order,
    ``((g0 + g1) + g2) + ...``, then dividing the sum by their number. Returns the parameters after
    every step. :func:`single_process_steps` (one backward over the whole batch) differs from it
    in the last bits: its matrix products sum over all the batch's tokens in another order."""
    micro_batches = list(micro_batches)
    if not micro_batches:
        raise ValueError("micro_batches must hold at least one batch of ids")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    params = []
    for _ in range(steps):
        for ids in micro_batches:
            next_token_loss(model, ids).backward()        # adds into p.grad: the sum in rank order
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(len(micro_batches))
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return params


def demo(rank: int, world_size: int, steps: int = 3, batch_per_rank: int = 2, seq: int = 33,
         bucket_mb: float = 0.05, lr: float = 1e-2, seed: int = 0, **model_overrides) -> dict:
    """A few AdamW steps of data-parallel training, checked against the single process.

    Run it with ``llmu.distributed.launch(demo, 2)``. Every rank builds the same tiny Llama and the
    same global batch of ``world_size * batch_per_rank`` random sequences from ``seed``, trains a
    data-parallel replica on its shard and, beside it, a single-process copy on the whole batch.
    Returns a dict: ``max_abs_error`` (per step, the largest parameter difference from the single
    process), ``loss`` (this rank's shard loss per step), ``buckets`` (per bucket: parameter
    names, bytes, launch and completion times of the last step, seconds from the forward's start)
    and ``timeline`` (forward end, backward start and end, finish end of the last step).
    """
    torch.manual_seed(seed)
    model = _tiny_model(seed, **model_overrides)
    reference = _tiny_model(seed, **model_overrides)
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (world_size * batch_per_rank, seq), generator=torch.Generator().manual_seed(seed + 1))
    mine = ids[rank * batch_per_rank:(rank + 1) * batch_per_rank]

    _, ref_params = single_process_steps(reference, ids, steps, lr)
    dp = DataParallel(model, bucket_mb=bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    errors, losses = [], []
    for step in range(steps):
        loss = next_token_loss(dp, mine)
        loss.backward()
        dp.finish()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        errors.append(max((p - ref_params[step][n]).abs().max().item() for n, p in model.named_parameters()))
    timeline = {k: v for k, v in dp.timeline.items() if k != "buckets"}
    return {"max_abs_error": errors, "loss": losses, "buckets": dp.timeline["buckets"], "timeline": timeline}
