"""Pages the destination already holds (its prefix cache, `Target.cached_blocks`) are neither read
on the source nor written on the destination; the rest of the KV and the GDN state move as usual.
Two real endpoints in one process (loopback)."""

from __future__ import annotations

import pytest

from tests.helpers.xfer_state import global_state, make_pools, mismatches, place, snapshot
from tests.transfer.test_transfer_local import TOKENS, _drive, _pair

pytestmark = pytest.mark.timeout(120)
BS = 4  # xfer_state.engine_cfg's block size


@pytest.mark.parametrize("backend", ["nixl", "ucxx"])
@pytest.mark.parametrize("tokens,cached", [(TOKENS, 2), (16, 4)])  # (16, 4): only the GDN state moves
def test_cached_pages_are_neither_read_nor_written(backend, tokens, cached):
    model, sc, dc, tx, rx = _pair(backend)
    try:
        nb = -(-tokens // BS)
        state = global_state(model, tokens, BS, 5)
        src = tx.blocks.allocate(nb)
        src_slot = tx.slots.allocate()
        place(tx.pools, sc, 0, state, src, src_slot)
        for t in tx.pools.kv.values():  # a read of a skipped source page would carry this
            t[src[:cached]] = 7.0
        dst = rx.blocks.allocate(nb + 1)  # prompt + the first decoded token
        dst_slot = rx.slots.allocate()
        before = snapshot(rx.pools)
        r = rx.adopt("q", tokens, dst, dst_slot, cached_blocks=cached)
        target = rx.target([r.target], "q", tokens, cached_blocks=cached)
        s = tx.send("q", target, src, src_slot, tokens, owned=True)
        _drive(tx, rx, until=lambda: s.state.terminal and s.quiet and r.state.terminal)
        assert (s.state.value, r.state.value) == ("done", "done"), (s.error, r.error)

        # expected: the pools as they were, with the cached pages untouched, the other pages and the GDN state written
        exp = make_pools(dc, 0)
        for kind, layer, t in exp.tensors():
            t.copy_(before[(kind, layer)])
        rest = {**state, "kv": {i: kv[cached:] for i, kv in state["kv"].items()}}
        place(exp, dc, 0, rest, dst[cached:nb], dst_slot)
        assert mismatches(rx.pools, snapshot(exp)) == []

        # bytes moved, from the pool shapes: a page of every KV layer per new page, one slot per GDN layer
        page = sum(t[0].numel() * t.element_size() for t in rx.pools.kv.values())
        slot = sum(t[0].numel() * t.element_size() for p in (rx.pools.conv, rx.pools.recurrent) for t in p.values())
        assert s.nbytes == (nb - cached) * page + slot
        r.take()
        assert tx.blocks.num_free == tx.blocks.num_blocks and tx.slots.num_free == tx.slots.num_slots
    finally:
        tx.close()
        rx.close()


def test_a_source_that_skips_other_pages_than_the_reservation_is_refused():
    model, sc, dc, tx, rx = _pair()
    try:
        nb = -(-TOKENS // BS)
        src, src_slot = tx.blocks.allocate(nb), tx.slots.allocate()
        dst, dst_slot = rx.blocks.allocate(nb + 1), rx.slots.allocate()
        r = rx.adopt("q", TOKENS, dst, dst_slot, cached_blocks=2, free=lambda b, s: None)
        s = tx.send("q", rx.target([r.target], "q", TOKENS, cached_blocks=1), src, src_slot, TOKENS)
        _drive(tx, rx, until=lambda: s.state.terminal and r.state.terminal and r.freed)
        assert "refused" in s.error and "skips 1 cached blocks, this reservation has 2" in s.error
        with pytest.raises(Exception, match="cached blocks in a reservation"):
            rx.adopt("x", TOKENS, dst, dst_slot, cached_blocks=nb)  # 15 tokens: 3 full pages at most
    finally:
        tx.close()
        rx.close()
