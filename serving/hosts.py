"""Which host a server tells its peers to dial: the one it binds, or, bound to a wildcard
(0.0.0.0, every interface), this machine's primary address: 0.0.0.0 is no address a peer on
another machine can dial, and it says nothing in a log. And whether a host to bind resolves at
all, checked before any server starts."""

from __future__ import annotations

import ipaddress
import socket

WILDCARDS = ("", "0.0.0.0", "::", "*")


def primary_address() -> str:
    """The address other machines reach this one at: the source address of its route outward (a UDP
    socket connected, no packet sent), else what its host name resolves to off the loopback, else
    127.0.0.1."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: the kernel picks the route, nothing is sent
            ip = s.getsockname()[0]
        if ip and not ipaddress.ip_address(ip).is_unspecified:
            return str(ip)
    except OSError:  # no route outward
        pass
    try:
        for *_, addr in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            if not ipaddress.ip_address(addr[0]).is_loopback:
                return str(addr[0])
    except OSError:
        pass
    return "127.0.0.1"


def advertised_host(bind: str, given: str | None = None) -> str:
    """The host a server bound to `bind` gives its peers: `given` (--advertise-host), else `bind`
    itself, or this machine's primary address when `bind` is a wildcard."""
    if given:
        return given
    return primary_address() if bind in WILDCARDS else bind


def unresolved(host: str) -> str | None:
    """Why `host` (to bind; a wildcard binds every interface) names no address here, or None when
    it resolves."""
    if host in WILDCARDS:
        return None
    try:
        socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"{host!r} does not resolve ({e.strerror or e})"
    return None
