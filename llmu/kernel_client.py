"""A Jupyter kernel client that never sleeps through a kernel's reply.

Measured here: now and then a notebook cell "took" exactly the per-cell time limit although the
kernel had finished it in a second (2 runs in 10 of 05_prefill_decode's ``points`` cell under
self-grading; 11_speculative_decoding took 187 s instead of about 37 in one run of the suite, with
a 150 s limit). The kernel's reply was on the socket; the client's single long ``poll(timeout)``
did not wake for it and returned it only when the timeout ran out. (zmq signals a socket's
readiness by an edge on a file descriptor, and an edge can be consumed unseen, e.g. by a send on
the same socket.) Waiting in short slices, each a fresh poll, bounds what a missed edge costs.

Everything in llmu that executes notebooks uses it: nbgrader's validate and autograde (through
``c.AsyncKernelManager.client_class`` in :func:`llmu.course.nbgrader_config`) and ``llmu grade``.
"""

from __future__ import annotations

import time

from jupyter_client.asynchronous import AsyncKernelClient

#: Longest single wait on a kernel channel (seconds); see :func:`poll_in_slices`.
POLL_SLICE_S = 0.5


def poll_in_slices(channel, slice_s: float = POLL_SLICE_S) -> None:
    """Make ``channel.get_msg(timeout)`` wait in short slices instead of one long poll: a new poll
    every ``slice_s`` looks at the socket again, so a missed readiness edge costs at most
    ``slice_s`` (module docstring)."""
    from queue import Empty

    get_msg = channel.get_msg

    async def sliced_get_msg(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = slice_s if deadline is None else max(0.0, min(slice_s, deadline - time.monotonic()))
            try:
                return await get_msg(timeout=left)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    channel.get_msg = sliced_get_msg


class SlicedPollKernelClient(AsyncKernelClient):
    """jupyter_client's asynchronous kernel client, with :func:`poll_in_slices` on the channels
    that nbclient waits on (shell replies and iopub messages)."""

    def start_channels(self, *args, **kwargs):
        super().start_channels(*args, **kwargs)
        poll_in_slices(self.shell_channel)
        poll_in_slices(self.iopub_channel)
