"""NIXL between processes from GPU memory (needs a GPU): every rank's pools lie on CUDA device 0
and are registered as VRAM; the source ranks hold a 4k-token request's KV pages and GDN state at
Qwen3.5-35B-A3B's per-layer sizes (2 KV heads of 256, 16 key / 32 value GDN heads of 128, conv
kernel 4), and after the transfer the destination ranks' pools equal, byte for byte, the global
state re-sharded for them (through engine.shard, not the transfer's plan), with every byte they
did not own untouched. Two requests are in flight at once."""

from __future__ import annotations

import pytest

from tests.helpers.xfer_harness import Cluster

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

MODEL = dict(
    hk=16,
    hv=32,
    kvh=2,
    num_attention_heads=16,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    max_position_embeddings=8192,
)
TOKENS = 4091  # 256 pages of 16, the last one partly filled


@pytest.mark.parametrize("a,b", [(1, 1), (2, 1), (1, 2)], ids=["1to1", "2to1", "1to2"])
def test_vram_transfer_is_byte_exact(hosts, a, b):
    rids = {"r1": (21, TOKENS), "r2": (22, TOKENS - 1000)}
    with Cluster(hosts, "nixl", a, b, MODEL, device="cuda", block_size=16, memory="192MiB") as c:
        targets = {}
        for rid, (seed, tokens) in rids.items():
            c.fill(rid, seed=seed, tokens=tokens)
            targets[rid] = c.reserve(rid, tokens)
        for rid, (_, tokens) in rids.items():
            c.send(rid, targets[rid], tokens)
        for rid in rids:
            assert c.wait(c.dst, rid, timeout=120) == [("done", None)] * b
            assert c.wait(c.src, rid, timeout=120) == [("done", None)] * a
        for p in c.dst:
            bad = p.call("check", [(rid, seed, tokens) for rid, (seed, tokens) in rids.items()], timeout=300)[0]
            assert bad == [], f"{p.agent}: {bad}"
            for rid in rids:
                p.call("release", rid)
        c.assert_counts_initial()


def test_push_waits_for_the_kernel_that_wrote_the_pages(hosts):
    """The source state lands after a kernel that sleeps about a second on the GPU, and the
    request is pushed at once: the sender waits on the fence recorded after that write (what a
    rank records after each step), so the destination still receives the computed bytes. No
    checksum: computing it reads the pages on the host, which would wait for the kernel anyway."""
    spec = dict(device="cuda", block_size=16, memory="192MiB", checksum=False)
    with Cluster(hosts, "nixl", 2, 1, MODEL, **spec) as c:
        c.fill("late", seed=31, tokens=TOKENS, late=2_000_000_000)
        target = c.reserve("late", TOKENS)
        c.send("late", target, TOKENS)
        assert c.wait(c.dst, "late", timeout=120) == [("done", None)]
        assert c.wait(c.src, "late", timeout=120) == [("done", None)] * 2
        bad = c.dst[0].call("check", [("late", 31, TOKENS)], timeout=300)[0]
        assert bad == [], bad
        c.dst[0].call("release", "late")
        c.assert_counts_initial()
