"""The transfer layer's errors cross a tensor-parallel rank's pipe as themselves (pickled, then
raised by the executor's `call_all`, engine/executor.py): every field and the message survive, so
a node handles a rank's HandshakeError or PeerUnreachable by its type as with one rank."""

from __future__ import annotations

import pickle

from transfer.errors import HandshakeError, PeerUnreachable, PlanError, TransferError


def test_each_transfer_error_pickles_with_its_fields():
    cases = [
        HandshakeError("dtype", "torch.bfloat16", "torch.float32", "no plan converts"),
        PeerUnreachable("NIXL_ERR_BACKEND", "decode-0", "decode-0/r1"),
        PlanError("block 9 outside 0..7"),
        TransferError("request r is done"),
    ]
    for e in cases:
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and back.__dict__ == e.__dict__
        assert type(e).crosses_ranks
    h = pickle.loads(pickle.dumps(cases[0]))
    assert (h.field, h.local, h.remote, h.detail) == ("dtype", "torch.bfloat16", "torch.float32", "no plan converts")
