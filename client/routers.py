"""The routers a client talks to, shared by Client and AsyncClient.

Several routers can front the same pools ("a:1,b:2" or a list). Calls go to the current one; a
call that fails UNAVAILABLE before its first token never produced anything (router down, or
draining), so it is made again on the next router, each router once, and that router becomes
the current one.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc

from client.types import PdserveError
from proto import pb, rpc
from proto.serving import addresses

GENERATION = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class Routers:
    """One channel (Generation and Health stubs) per router; `cur` is where calls go first."""

    def __init__(self, addr, make_channel):
        self.addrs = addresses(addr)
        if not self.addrs:
            raise ValueError("give at least one router address (host:port)")
        self.chans = [make_channel(a) for a in self.addrs]
        self.stubs = [rpc.GenerationStub(c) for c in self.chans]
        self.healths = [health_pb2_grpc.HealthStub(c) for c in self.chans]
        self.cur = 0
        self.why: dict[str, str] = {}  # per router, why it was not ready at the last check

    def use(self, i: int) -> None:
        self.cur = i % len(self.addrs)

    def generate(self, req: pb.GenerateRequest, timeout: float | None):
        """`start(i)` for a stream: the Generate call on router i."""
        return lambda i: self.stubs[i % len(self.stubs)].Generate(req, timeout=timeout)

    def not_ready(self, timeout: float) -> TimeoutError:
        why = ", ".join(f"{a}: {self.why.get(a, 'not reachable')}" for a in self.addrs)
        return TimeoutError(f"no router ready after {timeout:g} s ({why})")


class StreamBase:
    """A Generate call that fails over to the next router before its first token."""

    def __init__(self, start, routers: Routers):
        self._start, self._routers = start, routers
        self._i = routers.cur
        self._left = len(routers.addrs) - 1
        self._call = start(self._i)
        self.closed = False

    def _on_error(self, e: grpc.RpcError, yielded: bool) -> bool:
        """After the call failed: True when it was made again on the next router (go on), False
        when closing the stream ended it; raises PdserveError otherwise."""
        if self.closed and e.code() == grpc.StatusCode.CANCELLED:
            return False
        if self._left > 0 and not self.closed and not yielded and e.code() == grpc.StatusCode.UNAVAILABLE:
            self._left -= 1
            self._i += 1
            self._call = self._start(self._i)
            self._routers.use(self._i)
            return True
        raise PdserveError.from_rpc(e) from None
