"""Errors of the transfer layer; each names what was refused and why."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer could not be set up or did not complete. Raised in a tensor-parallel rank, it
    reaches the node as itself (`crosses_ranks`, engine/executor.py), so each subclass pickles."""

    crosses_ranks = True


class HandshakeError(TransferError):
    """Two endpoints cannot exchange state: `field` differs and no plan can bridge it."""

    def __init__(self, field: str, local: object, remote: object, detail: str = ""):
        self.field, self.local, self.remote = field, local, remote
        extra = f"; {detail}" if detail else ""
        self.detail = detail
        super().__init__(f"transfer handshake refused: {field} differs (local {local!r}, remote {remote!r}){extra}")

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return type(self), (self.field, self.local, self.remote, self.detail)


class PlanError(TransferError):
    """The request's block ids or slots do not fit the schemas."""


class PeerUnreachable(TransferError):
    """A peer's transfer agent could not be connected to at handshake (its process is gone, or its
    data-plane address is not reachable from here): the peer is at fault, not this endpoint."""

    def __init__(self, why: str, node: str = "", agent: str = ""):
        self.why, self.node, self.agent = why, node, agent
        who = f"transfer agent {agent} of {node}" if node else "the peer's transfer agent"
        super().__init__(f"{who} unreachable: {why}")

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return type(self), (self.why, self.node, self.agent)
