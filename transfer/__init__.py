"""Typed transfer of one request's hybrid state (paged KV + GDN conv/recurrent) from the prefill
node's ranks (TP=a) to the decode node's (TP=b): schema, handshake, re-sharding plan, messages,
the Transport registry and its NIXL / UCXX backends, and the endpoints that run the protocol.
Endpoints never block and start no thread. docs/transfer.md, docs/DESIGN.md §1, §4."""

from transfer.backend import TRANSPORTS, TransferState, get_transport
from transfer.config import TransferConfig
from transfer.errors import HandshakeError, PlanError, TransferError
from transfer.messages import Target, TargetRank, decode_target, encode_target
from transfer.plan import Range, pair_templates, plan
from transfer.receiver import Receiver, RecvRequest
from transfer.schema import SCHEMA_VERSION, ModelDigest, PeerInfo, RankSchema, TensorDesc, build_schema
from transfer.sender import Sender, SendRequest

__all__ = [
    "SCHEMA_VERSION",
    "TRANSPORTS",
    "HandshakeError",
    "ModelDigest",
    "PeerInfo",
    "PlanError",
    "Range",
    "RankSchema",
    "Receiver",
    "RecvRequest",
    "Sender",
    "SendRequest",
    "Target",
    "TargetRank",
    "TensorDesc",
    "TransferConfig",
    "TransferError",
    "TransferState",
    "build_schema",
    "decode_target",
    "encode_target",
    "get_transport",
    "pair_templates",
    "plan",
]
