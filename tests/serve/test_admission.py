"""router/admission.py in-process on an event loop: FIFO order, the queue limit, the timeout and
a client leaving the queue (its task cancelled), each with the outcome the router's metrics see."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from router.admission import Admission
from router.errors import Abort


def _refuse():
    return Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")


async def _scenario():
    left = []
    adm = Admission(max_queued=3, timeout_s=5.0, on_leave=lambda o, w: left.append(o))
    room = {"n": 0}
    order = []

    def place(i):
        def fn():
            if room["n"] > 0:
                room["n"] -= 1
                return i
            return None

        return fn

    async def wait(i):
        try:
            order.append(await adm.wait(place(i), _refuse))
        except Abort as a:
            order.append((i, a.code))
        except asyncio.CancelledError:
            order.append((i, "cancelled"))
            raise

    t0 = time.monotonic()
    tasks = []
    for i in range(3):  # arrive in order 0, 1, 2
        tasks.append(asyncio.create_task(wait(i)))
        while adm.depth() != i + 1:
            await asyncio.sleep(0.005)
    with pytest.raises(Abort) as ei:  # a fourth finds the queue full: refused at once
        await adm.wait(place(3), _refuse)
    assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "already wait" in ei.value.msg
    t = time.monotonic()
    tasks[1].cancel()  # the middle one leaves at once
    await asyncio.gather(tasks[1], return_exceptions=True)
    assert time.monotonic() - t < 0.5
    assert order == [(1, "cancelled")] and adm.depth() == 2
    room["n"] = 1  # room for one: the head (0) gets it, never 2
    adm.wake()
    await asyncio.wait_for(tasks[0], 2)
    assert order[-1] == 0 and adm.depth() == 1
    await asyncio.wait_for(tasks[2], 10)  # no more room: 2 times out after its 5 s
    assert order[-1] == (2, grpc.StatusCode.RESOURCE_EXHAUSTED) and time.monotonic() - t0 >= 5.0
    assert adm.depth() == 0
    assert sorted(left) == ["admitted", "cancelled", "queue_full", "timeout"]


def test_fifo_limit_timeout_and_cancel():
    asyncio.run(_scenario())
