"""Where the data plane listens: the network interface that holds a host address, as UCX names it
(`UCX_NET_DEVICES`). UCX's TCP transport otherwise opens a listening socket on every interface
of the machine, and the transfer has no authentication of its own; `ucx_net_devices` is set
around the creation of a UCX context (both backends) so that only the node's interface carries it.
A UCX_NET_DEVICES set in the environment is left as it is (RDMA clusters name their devices)."""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

WILDCARDS = ("", "0.0.0.0", "::", "*")
ENV = "UCX_NET_DEVICES"
_USER_SET = ENV in os.environ  # the operator's own choice, read before this module sets it
_IFF_LOOPBACK = 0x8


class _SockaddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16), ("addr", ctypes.c_ubyte * 4)]


class _SockaddrIn6(ctypes.Structure):
    _fields_ = [
        ("family", ctypes.c_ushort),
        ("port", ctypes.c_uint16),
        ("flowinfo", ctypes.c_uint32),
        ("addr", ctypes.c_ubyte * 16),
    ]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.c_void_p),
    ("netmask", ctypes.c_void_p),
    ("ifu", ctypes.c_void_p),
    ("data", ctypes.c_void_p),
]


def addresses() -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address, bool]]:
    """(interface, address, is loopback) for every address of this machine (getifaddrs)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    out: list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address, bool]] = []
    try:
        p = head
        while p:
            ifa = p.contents
            if ifa.addr and ifa.name:
                family = ctypes.cast(ifa.addr, ctypes.POINTER(ctypes.c_ushort)).contents.value
                ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None
                if family == socket.AF_INET:
                    ip = ipaddress.IPv4Address(bytes(ctypes.cast(ifa.addr, ctypes.POINTER(_SockaddrIn)).contents.addr))
                elif family == socket.AF_INET6:
                    raw = bytes(ctypes.cast(ifa.addr, ctypes.POINTER(_SockaddrIn6)).contents.addr)
                    ip = ipaddress.IPv6Address(raw)
                if ip is not None:
                    out.append((ifa.name.decode(), ip, bool(ifa.flags & _IFF_LOOPBACK)))
            p = ifa.next
    finally:
        libc.freeifaddrs(head)
    return out


def interface_of(host: str) -> str | None:
    """The interface that holds `host` (an address or a name of this machine); None for a wildcard
    (every interface). ValueError when no interface of this machine holds it."""
    if host in WILDCARDS:
        return None
    try:
        ips = {ipaddress.ip_address(host.strip("[]"))}
    except ValueError:
        try:
            ips = {ipaddress.ip_address(str(a[4][0]).split("%")[0]) for a in socket.getaddrinfo(host, None)}
        except OSError as e:
            raise ValueError(f"cannot resolve the data plane's host {host!r}: {e}") from None
    if any(ip.is_unspecified for ip in ips):
        return None
    have = addresses()
    for name, ip, _ in have:
        if ip in ips:
            return name
    if all(ip.is_loopback for ip in ips):  # 127.0.0.2 and the like: the loopback interface's range
        for name, _, loop in have:
            if loop:
                return name
    shown = ", ".join(f"{ip} ({name})" for name, ip, _ in have)
    raise ValueError(f"no network interface of this machine holds {host!r} (its addresses: {shown})")


@contextmanager
def ucx_net_devices(host: str | None) -> Iterator[str | None]:
    """UCX_NET_DEVICES set to `host`'s interface while the block runs (a UCX context reads it when
    it is created); yields the devices UCX will use (None: every one it finds)."""
    if _USER_SET or host is None:
        yield os.environ.get(ENV)
        return
    dev = interface_of(host)
    before = os.environ.get(ENV)
    if dev is not None:
        os.environ[ENV] = dev
    try:
        yield dev
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
