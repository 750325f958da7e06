"""`up --cpu-binding`, `--decode-nice` and `--yield-to-prefill-ms`: the CPUs each node on one host
gets, the priority decode nodes run at and how long they hold their steps for prompts computing for
them (router/cpu_binding.py), from the pure rules and as the started node processes hold them (their
affinity, nice value and autogroup nice, read from /proc; their torch threads and step hold, from
each node's start-up line; under `--node-start spawn` also their environment and command line),
with tokens still served through the 1P+1D path. The nodes are forked by `up`'s launcher in the
first cluster and started as processes of their own in the second."""

from __future__ import annotations

import os
import re

import pytest

from router.cpu_binding import (
    SHARED_DECODE_NICE,
    SHARED_DECODE_YIELD_MS,
    NodeSlot,
    decode_nice,
    decode_yield_ms,
    split_cpus,
)
from tests.helpers.serve_harness import Up, flags, node_pid

P, D, E = NodeSlot("prefill-0", "prefill"), NodeSlot("decode-0", "decode"), NodeSlot("encode-0", "encode")


def test_split_by_hand():
    assert split_cpus([0, 1], [P, D], "auto") == {"prefill-0": (0,), "decode-0": (1,)}
    # the remainder to the prefill node; ranks weigh: a TP=2 decode node gets twice a TP=1 share
    assert split_cpus([0, 1, 2], [P, D], "auto") == {"prefill-0": (0, 1), "decode-0": (2,)}
    d2 = NodeSlot("decode-0", "decode", ranks=2)
    assert split_cpus(list(range(6)), [P, d2], "auto") == {"prefill-0": (0, 1), "decode-0": (2, 3, 4, 5)}
    assert split_cpus([4, 5, 6, 7, 8], [P, D, E], "auto") == {
        "prefill-0": (4, 5),
        "decode-0": (6, 7),
        "encode-0": (8,),
    }


def test_nothing_bound_when_it_cannot_help():
    assert split_cpus([0, 1], [P, D], "none") == {}
    assert split_cpus([0, 1, 2, 3], [D], "auto") == {}  # one node: all of them anyway
    assert split_cpus([0, 1], [P, NodeSlot("decode-0", "decode", ranks=2)], "auto") == {}  # 3 ranks, 2 CPUs
    with pytest.raises(ValueError, match="--cpu-binding must be one of auto, none"):
        split_cpus([0, 1], [P, D], "even")  # type: ignore[arg-type]


@pytest.mark.parametrize("cpus", [2, 3, 5, 8, 13])
@pytest.mark.parametrize("shape", [(1, 1, 1, 0), (2, 1, 1, 1), (1, 2, 1, 0), (3, 2, 1, 2)])
def test_split_is_a_partition(cpus, shape):
    n_prefill, n_decode, n_encode, decode_tp = shape
    nodes = [NodeSlot(f"prefill-{i}", "prefill") for i in range(n_prefill)]
    nodes += [NodeSlot(f"decode-{i}", "decode", decode_tp or 1) for i in range(n_decode)]
    nodes += [NodeSlot(f"encode-{i}", "encode") for i in range(n_encode)]
    avail = list(range(100, 100 + cpus))
    got = split_cpus(avail, nodes, "auto")
    if cpus < sum(n.ranks for n in nodes):
        assert got == {}
        return
    seen = [c for n in nodes for c in got[n.name]]
    assert sorted(seen) == avail  # every CPU to exactly one node
    for n in nodes:
        assert len(got[n.name]) >= n.ranks  # a CPU per rank at least
        assert list(got[n.name]) == list(range(got[n.name][0], got[n.name][0] + len(got[n.name])))  # contiguous


def test_decode_yield_rule():
    assert decode_yield_ms(None, "none", 1, "cpu") == SHARED_DECODE_YIELD_MS > 0  # sharing the CPUs: prefill first
    assert decode_yield_ms(None, "auto", 1, "cpu") == 0.0  # CPUs of their own
    assert decode_yield_ms(None, "none", 0, "cpu") == 0.0  # colocated: no prefill node to give way to
    assert decode_yield_ms(None, "none", 1, "cuda") == 0.0  # the compute is on GPUs
    assert decode_yield_ms(20, "auto", 1, "cuda") == 20.0  # given: wins
    with pytest.raises(ValueError, match="--yield-to-prefill-ms must be >= 0"):
        decode_yield_ms(-1, "none", 1, "cpu")


def test_decode_nice_rule():
    assert decode_nice(None, "none", 1, "cpu") == SHARED_DECODE_NICE  # sharing the CPUs
    assert decode_nice(None, "auto", 1, "cpu") == 0  # CPUs of their own
    assert decode_nice(None, "none", 0, "cpu") == 0  # colocated: no prefill node to give way to
    assert decode_nice(None, "none", 1, "cuda") == 0  # the compute is on GPUs
    assert decode_nice(3, "auto", 1, "cuda") == 3  # given: wins
    with pytest.raises(ValueError, match="--decode-nice must be in 0..19"):
        decode_nice(20, "none", 1, "cpu")


def _nice(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[16])


def _group_nice(pid: int) -> int | None:
    """The nice value of the process's autogroup; None where the kernel has none."""
    try:
        return int(open(f"/proc/{pid}/autogroup").read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _held_ms(pid: int) -> float:
    """The --yield-to-prefill-ms a started node was given."""
    argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
    return float(argv[argv.index("--yield-to-prefill-ms") + 1])


def _share(up: Up, node: str) -> tuple[int, set[int], int, float]:
    """A node's start-up line: (torch threads, CPUs, nice, decode step hold in ms)."""
    line = up.find(rf"( {node}: \d+ torch threads on CPUs .*)")
    m = re.search(r"(\d+) torch threads on CPUs ([\d,]+), nice (\d+)(?:, decode steps held up to ([\d.]+) ms)?", line)
    assert m, line
    return int(m[1]), {int(c) for c in m[2].split(",")}, int(m[3]), float(m[4] or 0)


def _allowed(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


def _env(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_started_nodes_hold_their_share(ckpt):
    from client import Client

    mine = sorted(os.sched_getaffinity(0))
    up = Up("--model", ckpt, *flags(dtype="float32", decode=1, prefill=1, max_num_seqs=2, cpu_binding="auto"))
    try:
        pre, dec = node_pid(up, "prefill-0"), node_pid(up, "decode-0")
        want = split_cpus(mine, [P, D], "auto")
        assert _allowed(pre) == set(want["prefill-0"]) and _allowed(dec) == set(want["decode-0"])
        assert not _allowed(pre) & _allowed(dec) and _allowed(pre) | _allowed(dec) == set(mine)
        # forked by the launcher: threads sized to each node's share, though OpenMP loaded before it
        assert _share(up, "prefill-0") == (len(want["prefill-0"]), set(want["prefill-0"]), os.nice(0), 0.0)
        assert _share(up, "decode-0") == (len(want["decode-0"]), set(want["decode-0"]), os.nice(0), 0.0)
        assert _nice(dec) == _nice(pre) == os.nice(0)  # on CPUs of their own: no priority given away
        with Client(up.address, timeout=60) as c:
            c.wait_ready(timeout=30)
            r = c.generate(prompt_token_ids=[1, 2, 3, 4], max_tokens=4, temperature=0.0, ignore_eos=True)
            assert len(r.token_ids) == 4 and r.prefill_node == "prefill-0"
    finally:
        up.stop()
    up = Up("--model", ckpt, *flags(dtype="float32", decode=1, prefill=1, node_start="spawn"))  # binding: none
    try:
        for node in ("prefill-0", "decode-0"):
            pid = node_pid(up, node)
            assert _allowed(pid) == set(mine)
            assert _env(pid).get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")  # as inherited
        pre, dec = node_pid(up, "prefill-0"), node_pid(up, "decode-0")
        assert _nice(pre) == os.nice(0) and _nice(dec) == min(19, os.nice(0) + SHARED_DECODE_NICE)
        assert _held_ms(dec) == SHARED_DECODE_YIELD_MS  # sharing the CPUs: decode steps give way to prompts
        threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or len(mine)
        assert _share(up, "decode-0") == (threads, set(mine), _nice(dec), SHARED_DECODE_YIELD_MS)
        if _group_nice(dec) is not None:  # autogroups: each node's session is a group, weighed by its nice
            assert (_group_nice(pre), _group_nice(dec)) == (0, SHARED_DECODE_NICE)
        with Client(up.address, timeout=60) as c:
            c.wait_ready(timeout=30)
            r = c.generate(prompt_token_ids=[1, 2, 3, 4], max_tokens=4, temperature=0.0, ignore_eos=True)
            assert len(r.token_ids) == 4 and r.prefill_node == "prefill-0"
    finally:
        up.stop()
