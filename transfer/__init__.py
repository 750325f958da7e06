"""Typed transfer of one request's hybrid state (paged KV + GDN conv/recurrent) between the
prefill node's workers (TP=a) and the decode node's workers (TP=b). docs/DESIGN.md §1, §4.

Modules, by role:
- schema:     msgspec records each rank publishes (TensorDesc per pool, ModelDigest, version)
- handshake:  refuses a peer whose schema no plan can bridge, naming the field and both values
- plan:       pure re-sharding plan: byte ranges per (source rank, destination rank), coalesced
- messages:   control messages (Begin/Grant/Refuse/Done/Abort/Release) and the reservation Target
- backend:    the Transport interface, TransferState, the registry (nixl, ucxx)
- nixl_backend, ucxx_backend: the data planes
- endpoint, sender, receiver: the protocol (reservations, grants, notifications, leases, abort)

A worker creates its endpoint from the pools it holds:

    rx = Receiver(cfg, rank, pools, node="D0", blocks=block_manager, slots=slot_pool)   # decode
    tx = Sender(cfg, rank, pools, node="P0", blocks=block_manager, slots=slot_pool)     # prefill
    tx.add_peer(rx.metadata()); rx.add_peer(tx.metadata())                             # handshake
    r = rx.reserve("req-1", prompt_len)            -> r.target (TargetRank) -> router -> Target
        (or rx.adopt(request_id, prompt_len, blocks, slot, free=...) for memory the engine allocated)
    s = tx.send("req-1", target, src_blocks, src_slot, prompt_len, owned=True)
        (or s = tx.open(...) at prefill start; s.post(layers=..., final=False) per finished layer; s.post())
    poll both endpoints until s.state / r.state is DONE or FAILED; r.take() -> (blocks, slot)

Endpoints never block and start no thread: the owner calls poll() (each engine step).
"""

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
