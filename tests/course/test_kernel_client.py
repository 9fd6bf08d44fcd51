"""The kernel client every notebook run uses waits for replies in short slices
(``llmu.kernel_client``), and nbgrader's validate and autograde get it through the course's
configuration."""

from __future__ import annotations

import asyncio
import threading
import time
from queue import Empty

import nbformat

from llmu import course
from llmu.kernel_client import SlicedPollKernelClient, poll_in_slices


def _run(coroutine):
    """Run ``coroutine`` on a fresh event loop in a thread of its own: earlier tests in the same
    process (nbclient, Jupyter) may leave an event loop running in this one."""
    result = {}

    def target():
        try:
            result["value"] = asyncio.run(coroutine)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            result["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


class _Channel:
    """A channel whose message arrives after ``ready_after`` seconds; each get_msg call returns it
    only if it has arrived, after waiting at most its own timeout (as a zmq poll does when it does
    see the socket)."""

    def __init__(self, ready_after: float):
        self.ready_at = time.monotonic() + ready_after
        self.timeouts: list[float] = []

    async def get_msg(self, timeout=None):
        self.timeouts.append(timeout)
        wait = max(0.0, self.ready_at - time.monotonic())
        if timeout is not None and wait > timeout:
            await asyncio.sleep(timeout)
            raise Empty
        await asyncio.sleep(wait)
        return {"msg_type": "execute_reply"}


def test_waits_in_slices_until_the_message_comes():
    channel = _Channel(ready_after=0.3)
    poll_in_slices(channel, slice_s=0.05)
    assert _run(channel.get_msg(timeout=5)) == {"msg_type": "execute_reply"}
    assert len(channel.timeouts) > 3 and max(channel.timeouts) <= 0.05


def test_still_times_out_at_the_callers_deadline():
    channel = _Channel(ready_after=10)
    poll_in_slices(channel, slice_s=0.05)
    t0 = time.monotonic()
    try:
        _run(channel.get_msg(timeout=0.2))
    except Empty:
        pass
    else:
        raise AssertionError("get_msg returned before the message was there")
    assert 0.19 <= time.monotonic() - t0 < 1.0


def test_nbgrader_execution_uses_the_sliced_client():
    from nbgrader.preprocessors import Execute

    ex = Execute(config=course.nbgrader_config())
    ex.nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
    manager = ex.create_kernel_manager()
    assert isinstance(manager.client(), SlicedPollKernelClient)
