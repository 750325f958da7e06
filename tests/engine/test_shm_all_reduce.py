"""engine/shm_all_reduce.py between real processes: every rank ends with the sum of every rank's
tensor, taken here from the inputs in rank order, bit for bit, for float32, bfloat16 and int64,
odd sizes and a tensor larger than a slot (sent in pieces), over enough calls that both sets of
slots are reused many times; a rank whose peers never come raises instead of spinning for ever."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from engine import shm_all_reduce as shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="the shared-memory all-reduce is x86 only")

# (dtype, shape): a decode step's activations, an odd size, more than one slot (3 pieces, the last
# partial), integers
CASES = [
    (torch.float32, (32, 128)),
    (torch.bfloat16, (7, 333)),
    (torch.float32, (2 * shm.SLOT_BYTES // 4 + 1000,)),
    (torch.int64, (5, 3)),
]
ROUNDS = 6


def _inputs(world: int, round_: int, case: int) -> list[torch.Tensor]:
    dtype, shape = CASES[case]
    g = torch.Generator().manual_seed(1000 * round_ + 10 * case + world)
    if dtype == torch.int64:
        return [torch.randint(-1000, 1000, shape, generator=g) for _ in range(world)]
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]


def _rank(path: str, rank: int, world: int, q) -> None:
    torch.set_num_threads(1)
    ar = shm.ShmAllReduce(path, rank, world, timeout_s=60)
    out = []
    for round_ in range(ROUNDS):
        for case in range(len(CASES)):
            x = _inputs(world, round_, case)[rank].clone()
            if case == 1 and round_ % 2:  # a transposed view: summed in a copy, written back
                x = x.t().contiguous().t()
                assert not x.is_contiguous()
            assert ar(x) is x
            x = x.contiguous()
            out.append(x.view(-1).view(torch.uint8).numpy().tobytes())  # bytes: a tensor would go by a handle
    ar.close()
    q.put((rank, out))


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_sum_in_rank_order(world):
    ctx = mp.get_context("spawn")
    path, q = shm.create(world), ctx.Queue()
    try:
        procs = [ctx.Process(target=_rank, args=(path, r, world, q)) for r in range(world)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        os.unlink(path)
    i = 0
    for round_ in range(ROUNDS):
        for case in range(len(CASES)):
            xs = _inputs(world, round_, case)
            want = xs[0].clone()
            for x in xs[1:]:
                want += x
            for r in range(world):
                x = torch.frombuffer(bytearray(got[r][i]), dtype=torch.uint8).view(want.dtype).view(want.shape)
                assert torch.equal(x, want), (round_, case, r)
            i += 1


def test_a_rank_alone_raises_after_its_timeout():
    path = shm.create(2)
    try:
        ar = shm.ShmAllReduce(path, 0, 2, timeout_s=0.2)
        with pytest.raises(RuntimeError, match="rank 0 waited"):
            ar(torch.ones(4))
        ar.close()
    finally:
        os.unlink(path)
