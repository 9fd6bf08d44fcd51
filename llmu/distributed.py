"""Run a function on ``W`` real ``torch.distributed`` processes: the course's one launcher.

Every parallelism module of the course (expert, data, tensor, pipeline parallel) runs on real
processes that talk through ``torch.distributed``: gloo on CPU, NCCL on GPUs. Nothing is
simulated. :func:`launch` is the whole ceremony, in the order ``torchrun`` would do it:

1. pick a free TCP port on this machine (:func:`free_port`), where rank 0 will run the rendezvous;
2. start ``world_size`` fresh Python processes (the *spawn* start method: a fork of a process that
   already runs threads, a Jupyter kernel or a CUDA context is unsafe);
3. in each: one intra-op thread (``torch.set_num_threads(1)``: ``W`` processes share the cores),
   ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` in the environment,
   ``init_process_group(backend)``, and under NCCL ``torch.cuda.set_device(rank)`` (one GPU per rank);
4. call ``fn(rank, world_size, *args)``, destroy the group, send the return value home;
5. in the caller: gather the ``W`` return values in rank order, or raise :class:`RankError` with
   the traceback of the first rank that failed (and stop the others).

``fn`` crosses a process boundary, so it must be a function defined at the top level of a ``.py``
file (``llmu.moe.expert_parallel.demo``, a test file, a script), not a lambda or a function typed
into a notebook cell: each child imports it again, by module name or from the module's file. Its
arguments and return value are pickled: pass and return numbers or CPU tensors.

Example::

    from llmu.distributed import launch
    from llmu.moe.expert_parallel import demo
    results = launch(demo, 2)      # [rank 0's return value, rank 1's]
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["launch", "free_port", "device", "RankError", "BACKENDS"]

#: The backends :func:`launch` knows: gloo runs on CPUs, NCCL on CUDA GPUs.
BACKENDS = ("gloo", "nccl")


class RankError(RuntimeError):
    """A rank of :func:`launch` raised or died; the message holds its traceback."""

    def __init__(self, rank: int, details: str):
        super().__init__(f"rank {rank} failed:\n{details}")
        self.rank = rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device() -> torch.device:
    """Where this rank's tensors live: its GPU under NCCL, the CPU under gloo (or outside a group)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _address(fn) -> tuple[str, str | None, str]:
    """Where a child finds ``fn``: ``(module name, module file, qualified name)``."""
    name, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if name is None or qualname is None or "<" in qualname:   # <lambda>, <locals>
        raise TypeError(f"fn must be a function defined at the top level of a module, got {fn!r}")
    path = getattr(sys.modules.get(name), "__file__", None)
    if name == "__main__" and path is None:
        raise TypeError(f"fn={qualname} is defined in a notebook or an interactive session, where the new "
                        "processes cannot find it: define it in a .py file and import it")
    return name, path, qualname


def _find(name: str, path: str | None, qualname: str):
    """Import ``fn`` in a child: by module name, or from the module's file when the name alone is
    not importable there (a test file, a script run from elsewhere)."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        if path is None:
            raise
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    fn = module
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn


def _in_notebook() -> bool:
    """Whether this process is an IPython kernel or shell (where ``__main__`` is not a file)."""
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


@contextlib.contextmanager
def _children_skip_main():
    """While the children start, keep spawn from re-running a notebook's ``__main__`` in them.

    spawn prepares each child by importing the parent's ``__main__`` again, by its ``__spec__`` or
    from its ``__file__``. In a notebook, ``__main__`` is the notebook's namespace: it has no
    file of its own, but a library may have left a ``__file__`` there (Triton's interpreter does,
    when it runs a kernel defined in a cell), and the children would run that file and die. They
    need nothing from it (``fn`` is found by its module), so both attributes are hidden while the
    processes start and restored afterwards. A script's ``__main__`` is left alone.
    """
    main = sys.modules.get("__main__")
    if main is None or not _in_notebook():
        yield
        return
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _run_rank(rank, world_size, port, backend, timeout_s, fn_address, args, results):
    """The body of one child process (module-level so that spawn can import it)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    try:
        fn = _find(*fn_address)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        # Plain pickle, not the queue's own: torch's queue pickler shares tensors through shared
        # memory that dies with this process; plain pickle copies them into the message.
        results.put((rank, "ok", pickle.dumps(value), time.time()))
    except BaseException:  # noqa: BLE001 - every failure, KeyboardInterrupt included, goes home
        # The time tells the caller which failure came first: when one rank fails, its peers'
        # collectives fail next ("connection reset by peer"), and that is not the news.
        results.put((rank, "error", traceback.format_exc(), time.time()))


def _first_failure(rank, details, when, results, grace_s=1.0) -> RankError:
    """The error of the rank that failed first, among those that report within ``grace_s``."""
    failures = [(when, rank, details)]
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            other_rank, status, payload, other_when = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if status == "error":
            failures.append((other_when, other_rank, payload))
    failures.sort()
    _, first_rank, first_details = failures[0]
    others = [r for _, r, _ in failures[1:]]
    if others:
        first_details += f"\n(ranks {others} failed after it, most likely as a consequence)"
    return RankError(first_rank, first_details)


def launch(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes in one process group.

    Returns the ``world_size`` return values in rank order. Raises :class:`RankError` (with that
    rank's traceback) when a rank raises or dies. ``timeout_s`` is the group's timeout (a
    collective that waits longer for a peer fails, and so does its rank); a run still going 30 s
    after that raises ``TimeoutError``. The remaining processes are terminated in every case.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (the number of processes), got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size}, "
                         f"{torch.cuda.device_count()} GPU(s) visible; use backend='gloo' on CPU")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not callable(fn):
        raise TypeError(f"fn must be a function fn(rank, world_size, *args), got {type(fn).__name__}")
    fn_address = _address(fn)

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run_rank, daemon=True,
                         args=(rank, world_size, port, backend, timeout_s, fn_address, args, results))
             for rank in range(world_size)]
    with _children_skip_main():
        for p in procs:
            p.start()

    values: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s + 30.0   # the group's own timeout fires first
    try:
        while len(values) < world_size:
            try:
                rank, status, payload, when = results.get(timeout=0.2)
            except queue.Empty:
                # A rank that died without a word (killed, out of memory, a crash in C++)
                for rank, p in enumerate(procs):
                    if rank not in values and p.exitcode not in (None, 0) and results.empty():
                        raise RankError(rank, f"the process exited with code {p.exitcode} before returning "
                                              "(its own error message, if any, is on stderr)") from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in values]
                    raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout_s} s") from None
                continue
            if status == "error":
                raise _first_failure(rank, payload, when, results)
            values[rank] = pickle.loads(payload)
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
        results.close()
    return [values[rank] for rank in range(world_size)]
