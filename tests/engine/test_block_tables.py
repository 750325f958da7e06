"""Decode rows' page tables kept between steps (engine/block_tables.py) against the table made from
each step's page lists, as build_batch made it before: random runs of steps where requests grow a
page at a time, leave and come back, lose draft pages and get others at the same length, change
slots, and slots pass from one request to another; as a tensor and packed into a staged step's
buffer."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch

from engine.block_tables import BlockTables


def _from_lists(rows) -> torch.Tensor:
    width = max(len(r.block_ids) for r in rows)
    return torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in rows], dtype=torch.int64)


def test_kept_tables_equal_tables_from_the_lists():
    rng = random.Random(0)
    bt = BlockTables(max_pages=64, num_slots=2)  # slots beyond 2 grow the table
    pages: dict[str, list[int]] = {}
    slot_of: dict[str, int] = {}
    next_page = 1
    for step in range(400):
        # requests come and go; a slot freed is given to the next request
        if len(pages) < 6 and rng.random() < 0.3:
            rid = f"r{step}"
            free = sorted(set(range(8)) - set(slot_of.values()))
            slot_of[rid] = rng.choice(free)
            pages[rid] = list(range(next_page, next_page + rng.randint(1, 20)))
            next_page += 30
        for rid in list(pages):
            u = rng.random()
            if u < 0.05:  # finished
                del pages[rid], slot_of[rid]
            elif u < 0.15:  # a new page
                pages[rid].append(next_page)
                next_page += 1
            elif u < 0.2 and len(pages[rid]) > 1:  # a draft page dropped, another taken at the same length
                pages[rid][-1] = next_page
                next_page += 1
            elif u < 0.23 and len(pages[rid]) > 2:  # pages given back
                del pages[rid][-2:]
            elif u < 0.25:  # moved to another free slot
                free = sorted(set(range(8)) - set(slot_of.values()))
                if free:
                    slot_of[rid] = rng.choice(free)
        running = [rid for rid in pages if rng.random() < 0.9]  # some sit a step out
        if not running:
            continue
        running.sort(key=lambda r: slot_of[r])
        rows = [SimpleNamespace(request_id=r, slot=slot_of[r], block_ids=list(pages[r])) for r in running]
        if step % 2:  # the tables as a tensor, or packed into a buffer as a staged step writes them
            got = bt.rows(rows)
        else:
            out = np.full(len(rows) * 64 + 5, -7, dtype=np.int64)
            w = bt.rows_into(rows, out)
            assert (out[len(rows) * w :] == -7).all(), step  # nothing past the packed tables
            got = torch.from_numpy(out[: len(rows) * w].reshape(len(rows), w))
        assert torch.equal(got, _from_lists(rows)), step


def test_rows_in_any_slot_order():
    bt = BlockTables(max_pages=8)
    rows = [SimpleNamespace(request_id=r, slot=s, block_ids=b) for r, s, b in (("a", 5, [3, 4]), ("b", 1, [9]))]
    assert torch.equal(bt.rows(rows), torch.tensor([[3, 4], [9, 0]]))
    rows[1].block_ids = [9, 10, 11]
    assert torch.equal(bt.rows(rows), torch.tensor([[3, 4, 0], [9, 10, 11]]))


def test_a_request_back_after_a_step_out_is_written_again():
    """Preempted and admitted again into the same slot, a request may get other pages before its
    last one: a step away makes the row written whole."""
    bt = BlockTables(max_pages=8)
    a = SimpleNamespace(request_id="a", slot=0, block_ids=[3, 4, 5])
    other = SimpleNamespace(request_id="b", slot=1, block_ids=[7])
    bt.rows([a, other])
    bt.rows([other])  # a sits this step out
    a.block_ids = [6, 8, 5]
    assert torch.equal(bt.rows([a, other]), torch.tensor([[6, 8, 5], [7, 0, 0]]))
