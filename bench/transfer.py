"""Transfer benchmark (not a test): one request's hybrid state, prefill ranks -> decode rank.

Each rank its own process, TP 1->1 and 2->1; bytes, descriptors, time, and ratios against one
contiguous NIXL WRITE and a memcpy.

    python bench/transfer.py [--tokens 4096] [--reps 3] [--backend nixl|ucxx] [--device cuda] [--json OUT.json]
        [--shape 35b-a3b]   (per-layer KV and GDN state sizes of Qwen3.5-35B-A3B, 16 layers)"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as engine/__init__.py, which loads after torch here

import torch  # noqa: E402

from engine.cache.allocator import CachePools, plan_capacity  # noqa: E402
from engine.cache.spec import build_specs  # noqa: E402
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig  # noqa: E402

BLOCK = 16


# Per-layer state sizes: "default" (24 layers, 16 GDN value heads) and "35b-a3b": Qwen3.5-35B-A3B's
# attention KV (2 heads x 256) and GDN state (16 key heads x 128, 32 value heads x 128, conv
# kernel 4) in 16 layers (12 GDN, 4 attention) instead of its 40, so bytes per token per layer are real.
SHAPES: dict[str, dict] = {
    "default": {},
    "35b-a3b": dict(
        hidden_size=2048,
        num_attention_heads=16,
        linear_num_value_heads=32,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 4,
    ),
}


def model_config(shape: str = "default") -> ModelConfig:
    kw = dict(
        path="<bench>",
        architecture="Qwen3_5ForCausalLM",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3584,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 6,
        num_attention_heads=8,
        num_kv_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        dtype=torch.bfloat16,
    )
    return ModelConfig(**{**kw, **SHAPES[shape]})  # type: ignore[arg-type]


def engine_config(tp: int, max_tokens: int, shape: str = "default") -> EngineConfig:
    """A budget that fits one request of max_tokens (+1 for the first decode token) and 2 slots."""
    m = model_config(shape)
    probe = EngineConfig(m, ParallelConfig(tp), CacheConfig(BLOCK, "1GiB", 2), SchedulerConfig(max_num_seqs=2))
    specs = build_specs(probe, 0)
    state = 2 * sum(s.page_size_bytes for s in specs if s.kind == "gdn")
    block = sum(s.page_size_bytes for s in specs if s.kind == "paged_kv")
    budget = state + (max_tokens // BLOCK + 4) * block
    return EngineConfig(m, ParallelConfig(tp), CacheConfig(BLOCK, budget, 2), SchedulerConfig(max_num_seqs=2))


# -- rank processes ----------------------------------------------------------------------------


def rank_main(
    conn, role: str, tp: int, rank: int, max_tokens: int, backend: str, eh: bool, device: str, shape: str = "default"
) -> None:
    import msgspec  # noqa: PLC0415

    from transfer import Receiver, Sender, TransferConfig, decode_target  # noqa: PLC0415
    from transfer.plan import expand_arrays  # noqa: PLC0415

    cfg = engine_config(tp, max_tokens, shape)
    specs = build_specs(cfg, rank)
    pools = CachePools(specs, plan_capacity(specs, cfg.cache.memory_bytes, 2, BLOCK), device)
    ep = (Sender if role == "sender" else Receiver)(
        cfg, rank, pools, "P" if role == "sender" else "D", TransferConfig(backend=backend, ucxx_error_handling=eh)
    )
    reqs, scratch = {}, {}
    if backend == "nixl":  # a contiguous registered buffer for the one-WRITE baseline, before publishing
        n = sum(s.page_size_bytes * (-(-max_tokens // BLOCK) if s.kind == "paged_kv" else 1) for s in specs)
        scratch["buf"] = torch.zeros(n, dtype=torch.uint8, device=device)
        ep.transport.nx.register_memory(scratch["buf"])
        ep.info = msgspec.structs.replace(ep.info, transport=ep.transport.metadata())
    conn.send((ep.metadata(), scratch["buf"].data_ptr() if scratch else 0))
    for blob in conn.recv():
        ep.add_peer(blob)
    conn.send("ok")
    while True:
        if not conn.poll(0.0005):
            ep.poll()  # grants, Begins and Dones are answered between commands too
            continue
        cmd, *args = conn.recv()
        if cmd == "quit":
            ep.close()
            return
        if cmd == "reserve":
            rid, tokens = args
            reqs[rid] = ep.reserve(rid, tokens)
            conn.send(reqs[rid].target)
        elif cmd == "open":  # sender: allocate the prompt's blocks, Begin, wait for the grants
            rid, target, tokens = args
            target = decode_target(target)
            blocks = ep.blocks.allocate(-(-tokens // BLOCK))
            req = ep.open(rid, target, blocks, ep.slots.allocate(), tokens, owned=True)
            ep.wait(
                req, 30, until=lambda r: r.state.terminal or all(ch.granted for ch in r.channels.values()), sleep_s=0
            )
            assert not req.state.terminal, req.error
            reqs[rid] = req
            descs = 0
            for ch in req.channels.values():
                dst = ch.dst.blocks[: len(blocks)]
                descs += len(expand_arrays(ch.peer.pairs, blocks, dst, req.src_slot, ch.dst.slot)[0])
            conn.send(descs)
        elif cmd == "go":  # sender: post and wait until quiet
            req = reqs[args[0]]
            t0 = time.monotonic()
            req.post()
            ep.wait(req, 60, until=lambda r: r.state.terminal and r.quiet, sleep_s=0)
            assert req.state.value == "done", req.error
            stats = getattr(ep.transport, "last_post", {})
            conn.send((t0, stats.get("make_s", 0.0), stats.get("indices", 0), req.nbytes))
        elif cmd == "stream":  # sender: an opened request's prompt chunk by chunk (a sleep stands in for a
            # chunk's forward); mode "chunks" / "layers": its full pages written after each chunk, and
            # with "layers" each layer's rest as the last chunk's forward finishes the layer (the
            # chunk's sleep split evenly over its layers); then the rest ("single": everything)
            rid, chunk, chunk_s, mode = args
            req = reqs[rid]
            layers = len(cfg.model.layer_types)
            t_start = time.monotonic()
            for end in range(chunk, req.num_tokens + chunk, chunk):
                if mode == "layers" and end >= req.num_tokens:
                    for i in range(layers):
                        time.sleep(chunk_s / layers)
                        req.post(layers=[i], final=False)
                else:
                    time.sleep(chunk_s)
                if mode != "single" and end < req.num_tokens:
                    req.post_pages(end // BLOCK)
                ep.poll()  # an engine polls its transfers once per step
            t_first = time.monotonic()  # the first token exists
            req.post()
            ep.wait(req, 60, until=lambda r: r.state.terminal and r.quiet, sleep_s=0)
            assert req.state.value == "done", req.error
            conn.send((t_start, t_first, req.nbytes))
        elif cmd == "wait_done":  # receiver: poll until done (busy, or every args[1] s), report when, free
            conn.send("ready")
            req = ep.wait(reqs[args[0]], 60, sleep_s=args[1] if len(args) > 1 else 0.0)
            t = time.monotonic()
            assert req.state.value == "done", req.error
            req.release()
            conn.send(t)
        elif cmd == "raw_prep":  # sender: one descriptor each side, prepared once
            peer, remote_addr, n = args
            nx = ep.transport.nx
            buf = scratch["buf"]
            mem, dev = ("DRAM", 0) if buf.device.type == "cpu" else ("VRAM", buf.device.index or 0)
            scratch["local"] = nx.prep_xfer_dlist("NIXL_INIT_AGENT", [(buf.data_ptr(), n, dev)], mem)
            scratch["remote"] = nx.prep_xfer_dlist(peer, [(remote_addr, n, dev)], mem)
            scratch["peer"] = peer
            conn.send("ok")
        elif cmd == "raw_go":
            nx = ep.transport.nx
            t0 = time.monotonic()
            h = nx.make_prepped_xfer("WRITE", scratch["local"], [0], scratch["remote"], [0], b"raw")
            assert nx.transfer(h) != "ERR"
            while (s := nx.check_xfer_state(h)) == "PROC":
                pass
            assert s == "DONE"
            h.release()
            conn.send(t0)
        elif cmd == "raw_wait":  # receiver: until n raw notifications arrived
            n, got = args[0], 0
            conn.send("ready")
            nx = ep.transport.nx
            while got < n:
                got += sum(len(v) for v in nx.get_new_notifs().values())
            conn.send(time.monotonic())


# -- coordinator -------------------------------------------------------------------------------


class Ranks:
    """a source ranks (node P, TP=a) and one destination rank (node D), one process each."""

    def __init__(
        self, a: int, max_tokens: int, backend: str, eh: bool = True, device: str = "cpu", shape: str = "default"
    ):
        from transfer.schema import decode_peer  # noqa: PLC0415

        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for role, tp, rank in [("sender", a, r) for r in range(a)] + [("receiver", 1, 0)]:
            c, child = ctx.Pipe()
            p = ctx.Process(
                target=rank_main, args=(child, role, tp, rank, max_tokens, backend, eh, device, shape), daemon=True
            )
            p.start()
            self.procs.append(p)
            self.conns.append(c)
        metas, scratch = zip(*[self._recv(c) for c in self.conns])
        self.dst_scratch = scratch[-1]
        self.src, self.dst = self.conns[:a], self.conns[a]
        info = decode_peer(metas[-1])
        self.dst_agent, self.digest = info.agent, info.schema.digest.fingerprint()
        for c in self.src:
            c.send([metas[-1]])
        self.dst.send(list(metas[:-1]))
        for c in self.conns:
            self._recv(c)
        self.raw_ready: list[int] | None = None

    @staticmethod
    def _recv(c, timeout=120):
        if not c.poll(timeout):
            raise TimeoutError("a rank did not answer")
        return c.recv()

    def call(self, c, *cmd):
        c.send(cmd)
        return self._recv(c)

    def close(self):
        for c in self.conns:
            c.send(("quit",))
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.kill()

    def transfer(self, rid: str, tokens: int) -> dict:
        from transfer.messages import Target, encode_target  # noqa: PLC0415

        tr = self.call(self.dst, "reserve", rid, tokens)
        target = encode_target(Target(rid, "D", 1, self.digest, tokens, [tr]))
        opened = [self.call(c, "open", rid, target, tokens) for c in self.src]
        assert self.call(self.dst, "wait_done", rid) == "ready"
        for c in self.src:
            c.send(("go", rid))
        goes = [self._recv(c) for c in self.src]
        t_done = self._recv(self.dst)
        t0 = min(g[0] for g in goes)
        return dict(
            time=t_done - t0,
            make=max(g[1] for g in goes),
            idx=sum(g[2] for g in goes),
            bytes=sum(g[3] for g in goes),
            descs=sum(opened),
        )

    def contiguous(self, per_src: list[int]) -> float:
        """One contiguous NIXL WRITE per source rank (its share of the bytes), with a notification."""
        if self.raw_ready != per_src:
            off = 0
            for c, n in zip(self.src, per_src):
                self.call(c, "raw_prep", self.dst_agent, self.dst_scratch + off, n)
                off += n
            self.raw_ready = per_src
            self._raw_once()  # warm-up
        return self._raw_once()

    def _raw_once(self) -> float:
        self.dst.send(("raw_wait", len(self.src)))
        assert self._recv(self.dst) == "ready"
        for c in self.src:
            c.send(("raw_go",))
        t0 = min(self._recv(c) for c in self.src)
        return self._recv(self.dst) - t0


def memcpy_s(nbytes: int, reps: int, device: str = "cpu") -> float:
    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    b.copy_(a)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="source TP sizes (destination TP is 1)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backend", default="nixl", choices=["nixl", "ucxx"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where every rank's pools lie")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--shape", default="default", choices=sorted(SHAPES), help="per-layer state sizes (SHAPES)")
    ap.add_argument(
        "--no-ucx-error-handling",
        action="store_true",
        help="ucxx: endpoints without peer-failure handling (shared-memory transports)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for a in args.tp:
        ranks = Ranks(a, max(args.tokens), args.backend, not args.no_ucx_error_handling, args.device, args.shape)
        try:
            for tokens in args.tokens:
                warm = ranks.transfer(f"warm-{tokens}", tokens)  # connections, first touch of pages
                per_src = [warm["bytes"] // a] * a
                runs, contig = [], []
                for i in range(args.reps):  # interleaved, so load drift hits both alike
                    runs.append(ranks.transfer(f"r{tokens}-{i}", tokens))
                    if args.backend == "nixl":
                        contig.append(ranks.contiguous(per_src))
                res = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                res["contig"] = statistics.median(contig) if contig else None
                res["memcpy"] = memcpy_s(int(res["bytes"]), args.reps, args.device)
                rows.append((a, tokens, res))
                print(_fmt(a, tokens, res), flush=True)
        finally:
            ranks.close()
    print()
    print(
        f"backend {args.backend}, memory on {args.device}; ratios are baseline time / our time (1.0 = as fast as the baseline)"
    )
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|---|")
    for a, tokens, r in rows:
        print(_fmt(a, tokens, r))
    if args.json:
        out = [dict(r, tp=f"{a}->1", tokens=tokens, device=args.device, backend=args.backend) for a, tokens, r in rows]
        Path(args.json).write_text(json.dumps(out, indent=1))


HEADER = "| TP | tokens | MB | descs (indices) | make ms | time ms | GB/s | vs contig NIXL | vs memcpy |"


def _fmt(a, tokens, r) -> str:
    gbs = r["bytes"] / r["time"] / 1e9
    contig = f"{r['contig'] / r['time']:.2f} ({r['contig'] * 1e3:.1f} ms)" if r["contig"] else "-"
    memcpy = f"{r['memcpy'] / r['time']:.2f} ({r['memcpy'] * 1e3:.1f} ms)"
    return (
        f"| {a}->1 | {tokens} | {r['bytes'] / 1e6:.1f} | {int(r['descs'])} ({int(r['idx'])}) | "
        f"{r['make'] * 1e3:.2f} | {r['time'] * 1e3:.1f} | {gbs:.2f} | {contig} | {memcpy} |"
    )


if __name__ == "__main__":
    main()
