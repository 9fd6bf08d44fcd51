"""The kernel client every notebook run uses waits for replies in short slices
(``llmu.kernel_client``), and nbgrader's validate and autograde get it through the course's
configuration. The slicing is checked on a clock the test moves (each wait of the fake channel
advances it), not on the machine's: how many slices fit and when the deadline falls are then
exact, whatever the load."""

from __future__ import annotations

import asyncio
import threading
from queue import Empty

import nbformat
import pytest

from llmu import course, kernel_client
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
    """A channel whose message arrives at ``ready_at`` on ``clock``; each get_msg call returns it
    only if it has arrived, after waiting at most its own timeout (as a zmq poll does when it does
    see the socket). Waiting moves the clock forward instead of sleeping."""

    def __init__(self, clock, ready_at: float):
        self.clock, self.ready_at = clock, ready_at
        self.timeouts: list[float] = []

    async def get_msg(self, timeout=None):
        self.timeouts.append(timeout)
        await asyncio.sleep(0)          # a real await: the coroutine yields to the event loop
        wait = max(0.0, self.ready_at - self.clock.now)
        if timeout is not None and wait > timeout:
            self.clock.advance(timeout)
            raise Empty
        self.clock.advance(wait)
        return {"msg_type": "execute_reply"}


@pytest.fixture
def clock(fake_clock):
    """The monotonic clock ``poll_in_slices`` reads, moved only by the channel's waits."""
    return fake_clock(kernel_client)


# Slices and times are binary fractions (1/16 s, 5/16 s, 7/32 s), so the clock's sums are exact.
SLICE_S = 0.0625


def test_waits_in_slices_until_the_message_comes(clock):
    channel = _Channel(clock, ready_at=0.3125)
    poll_in_slices(channel, slice_s=SLICE_S)
    assert _run(channel.get_msg(timeout=5)) == {"msg_type": "execute_reply"}
    # four empty slices, then the one in which the message came; returned as soon as it came
    assert channel.timeouts == [SLICE_S] * 5 and clock.now == 0.3125


def test_still_times_out_at_the_callers_deadline(clock):
    channel = _Channel(clock, ready_at=10)
    poll_in_slices(channel, slice_s=SLICE_S)
    with pytest.raises(Empty):
        _run(channel.get_msg(timeout=0.21875))
    # three whole slices and the part of one left before the deadline: neither earlier nor later
    assert channel.timeouts == [SLICE_S] * 3 + [0.03125] and clock.now == 0.21875


def test_nbgrader_execution_uses_the_sliced_client():
    from nbgrader.preprocessors import Execute

    ex = Execute(config=course.nbgrader_config())
    ex.nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
    manager = ex.create_kernel_manager()
    assert isinstance(manager.client(), SlicedPollKernelClient)
