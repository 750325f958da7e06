"""router/admission.py in-process: FIFO order, the queue limit, the timeout and a client leaving
the queue, each with the outcome the router's metrics see."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from router.admission import Admission
from router.errors import Abort


class _Context:
    """The two things Admission uses of a gRPC servicer context."""

    def __init__(self):
        self.active, self.callbacks = True, []

    def is_active(self):
        return self.active

    def add_callback(self, fn):
        self.callbacks.append(fn)
        return True

    def cancel(self):
        self.active = False
        for fn in self.callbacks:
            fn()


def _refuse():
    return Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")


def test_fifo_limit_timeout_and_cancel():
    cond = threading.Condition()
    left = []
    adm = Admission(cond, max_queued=3, timeout_s=5.0, on_leave=lambda o, w: left.append(o))
    room = {"n": 0}
    order = []

    def place(i):
        def fn():
            if room["n"] > 0:
                room["n"] -= 1
                return i
            return None

        return fn

    def wait(i, ctx):
        try:
            order.append(adm.wait(place(i), ctx, _refuse))
        except Abort as a:
            order.append((i, a.code))

    ctxs = [_Context() for _ in range(3)]
    threads = []
    t0 = time.monotonic()
    for i, ctx in enumerate(ctxs):  # arrive in order 0, 1, 2
        threads.append(threading.Thread(target=wait, args=(i, ctx)))
        threads[-1].start()
        while adm.depth() != i + 1:
            time.sleep(0.005)
    with pytest.raises(Abort) as ei:  # a fourth finds the queue full: refused at once
        adm.wait(place(3), _Context(), _refuse)
    assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "already wait" in ei.value.msg
    t = time.monotonic()
    ctxs[1].cancel()  # the middle one leaves at once (the queue wakes on the callback)
    threads[1].join(2)
    assert not threads[1].is_alive() and time.monotonic() - t < 0.5
    assert order == [(1, grpc.StatusCode.CANCELLED)] and adm.depth() == 2
    with cond:  # room for one: the head (0) gets it, never 2
        room["n"] = 1
        cond.notify_all()
    threads[0].join(2)
    assert order[-1] == 0 and adm.depth() == 1
    threads[2].join(10)  # no more room: 2 times out after its 5 s
    assert order[-1] == (2, grpc.StatusCode.RESOURCE_EXHAUSTED) and time.monotonic() - t0 >= 5.0
    assert adm.depth() == 0
    assert sorted(left) == ["admitted", "cancelled", "queue_full", "timeout"]
