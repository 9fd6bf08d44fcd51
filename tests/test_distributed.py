"""llmu.distributed.launch: real processes in one gloo group, their return values in rank order, a
failing rank's own traceback, refusals of bad arguments, and a notebook's ``__main__`` kept out of
the children."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import llmu  # noqa: F401
from llmu import distributed
from llmu.distributed import RankError, free_port, launch


def _rank_and_sum(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world, t.item()


def test_launch_returns_every_ranks_value_in_rank_order():
    assert launch(_rank_and_sum, 3) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_launch_from_a_notebook_does_not_rerun_its_main(tmp_path, monkeypatch):
    # In a notebook kernel __main__ is the notebook's namespace. Triton's interpreter sets a
    # __file__ there when it runs a kernel defined in a cell; multiprocessing's spawn would run that
    # file as the children's __main__ and they would die before reaching fn.
    trap = tmp_path / "not_a_main_module.py"
    trap.write_text("raise SystemExit('a child ran the parent __main__ file')\n")
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__file__", str(trap), raising=False)
    monkeypatch.setattr(main, "__spec__", None, raising=False)
    monkeypatch.setattr(distributed, "_in_notebook", lambda: True)
    assert launch(_rank_and_sum, 2) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert main.__file__ == str(trap)           # restored for the notebook




def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ZeroDivisionError("rank one divided by zero on purpose")
    dist.barrier()      # rank 0 waits for rank 1, whose death then breaks this collective too
    return rank


def test_launch_raises_the_failing_ranks_traceback():
    with pytest.raises(RankError, match="rank 1 failed") as info:
        launch(_fail_on_rank_one, 2, timeout_s=30)
    assert info.value.rank == 1
    assert "ZeroDivisionError: rank one divided by zero on purpose" in str(info.value)
    assert "_fail_on_rank_one" in str(info.value)        # the traceback names the function


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True])
def test_launch_refuses_a_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size"):
        launch(_fail_on_rank_one, bad)


def test_launch_refuses_bad_options():
    with pytest.raises(ValueError, match="backend"):
        launch(_fail_on_rank_one, 2, backend="mpi")
    with pytest.raises(ValueError, match="timeout_s"):
        launch(_fail_on_rank_one, 2, timeout_s=0)
    with pytest.raises(TypeError, match="fn"):
        launch("not a function", 2)
    with pytest.raises(TypeError, match="top level of a module"):      # the children could not import it
        launch(lambda rank, world: rank, 2)
    with pytest.raises(ValueError, match="one CUDA GPU per rank"):
        launch(_fail_on_rank_one, torch.cuda.device_count() + 1, backend="nccl")


def test_free_port_can_be_bound():
    import socket

    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
