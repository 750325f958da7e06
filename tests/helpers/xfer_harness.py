"""Multi-process harness: each TP rank of the source (prefill) and destination (decode) node is a
separate process (multiprocessing spawn) with a real transfer endpoint on loopback. The test
process plays the router: it carries metadata and targets and drives the ranks by command.

Host processes are spawned once per backend and reused by the tests (importing torch and NIXL
costs seconds per process on a small machine); each test gets fresh endpoints (new agents, new
incarnations) in them. A killed host is replaced. Every wait has a timeout; a host that does
not answer in time is killed.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
import traceback

import msgspec

TIMEOUT_S = 60.0


# -- the rank process --------------------------------------------------------------------------


def _host_main(conn) -> None:
    """A host process: serves one endpoint per ("setup", spec) until "close"; "quit" ends it."""
    logging.basicConfig(level=logging.WARNING)
    import transfer  # noqa: F401, PLC0415 (pay the imports once, before the first test)

    while True:
        cmd, *args = conn.recv()
        if cmd == "quit":
            return
        if cmd == "close":  # the endpoint already ended (crashed)
            conn.send(("ok",))
            continue
        try:
            _serve(conn, args[0])
        except Exception:  # noqa: BLE001 (reported to the test process, which fails the test)
            conn.send(("crash", traceback.format_exc()))


def _serve(conn, spec: dict) -> None:
    import torch  # noqa: PLC0415

    from engine.devices import StepFence  # noqa: PLC0415
    from tests.helpers.xfer_state import (  # noqa: PLC0415
        engine_cfg,
        global_state,
        make_pools,
        mismatches,
        noise,
        place,
        snapshot,
        tiny_model,
    )
    from transfer import Receiver, Sender, TransferConfig, decode_target  # noqa: PLC0415
    from transfer.messages import Done, encode_control  # noqa: PLC0415

    model = tiny_model(**spec["model"])
    cfg = engine_cfg(model, spec["tp"], block_size=spec.get("block_size", 4), memory=spec.get("memory", "96KiB"))
    rank = spec["rank"]
    device = spec.get("device", "cpu")
    pools = make_pools(cfg, rank, device)
    noise(pools, seed=1000 * (spec["role"] == "receiver") + 10 * spec["tp"] + rank)
    initial = snapshot(pools)
    tcfg = TransferConfig(
        backend=spec["backend"], checksum=spec.get("checksum", True), lease_s=spec.get("lease_s", 60.0)
    )
    cls = Sender if spec["role"] == "sender" else Receiver
    fence = StepFence(torch.device(device))  # what a rank records after each step
    ep = cls(cfg, rank, pools, spec["node"], tcfg, fence=fence)
    free0 = (ep.blocks.num_free, ep.slots.num_free)
    conn.send(("meta", ep.metadata(), ep.agent, ep.digest, free0))
    reqs: dict = {}

    def wait(rid, timeout, cond):
        deadline = time.monotonic() + timeout
        r = reqs[rid]
        while not cond(r):
            if time.monotonic() > deadline:
                return False
            ep.poll()
            time.sleep(0.0002)
        return True

    while True:
        if not conn.poll(0.001):
            ep.poll()
            continue
        cmd, *args = conn.recv()
        if cmd == "close":
            ep.close()
            conn.send(("ok",))
            return
        if cmd == "peers":
            conn.send(("ok", [ep.add_peer(b) for b in args[0]]))
        elif cmd == "fill":  # sender: a prefill's state in non-trivial block ids
            rid, seed, tokens, late = args
            n = -(-tokens // cfg.cache.block_size)
            ids = ep.blocks.allocate(n + 2)
            blocks = ids[: n // 2] + ids[n // 2 + 2 :]  # two runs of consecutive ids
            ep.blocks.free(ids[n // 2 : n // 2 + 2])
            slot = ep.slots.allocate()
            state = global_state(model, tokens, cfg.cache.block_size, seed)
            if late:  # CUDA: the state lands after a kernel sleeping `late` cycles, then the fence
                scratch = make_pools(cfg, rank, device)
                for (_, _, t), (_, _, s) in zip(pools.tensors(), scratch.tensors()):
                    s.copy_(t)
                place(scratch, cfg, rank, state, blocks, slot)
                torch.cuda._sleep(late)
                for (_, _, t), (_, _, s) in zip(pools.tensors(), scratch.tensors()):
                    t.copy_(s, non_blocking=True)
                fence.record()
            else:
                place(pools, cfg, rank, state, blocks, slot)
            reqs[rid] = (blocks, slot)
            conn.send(("ok", blocks, slot))
        elif cmd == "reserve":
            rid, tokens, lease = args
            r = ep.reserve(rid, tokens, lease_s=lease)
            reqs[rid] = r
            conn.send(("ok", msgspec.msgpack.encode(r.target)))
        elif cmd == "send":  # sender: mode "all" (one final post) or "partial" (KV layers only, not final)
            rid, target, tokens, mode = args
            blocks, slot = reqs[rid]
            req = ep.open(rid, decode_target(target), blocks, slot, tokens, owned=True)
            if mode == "all":
                req.post()
            else:
                req.post(layers=model.attention_layers, final=False)
            reqs[rid] = req
            conn.send(("ok",))
        elif cmd == "finish":  # sender: post the rest
            reqs[args[0]].post()
            conn.send(("ok",))
        elif cmd == "wait":  # until terminal (and quiet for senders / freed for failed receivers)
            rid, timeout, what = args
            conds = {
                "terminal": lambda r: r.state.terminal,
                "transferring": lambda r: r.state.value != "pending",
                # sender: quiet (no write reads its pages, owned memory back); receiver: done or freed
                "settled": (lambda r: r.state.terminal and r.quiet)
                if spec["role"] == "sender"
                else (lambda r: r.state.value == "done" or r.freed),
            }
            ok = wait(rid, timeout, conds[what])
            r = reqs[rid]
            conn.send(("ok", ok, r.state.value, r.error))
        elif cmd == "check":  # receiver: pools == initial noise + each request's re-sharded global state
            exp_pools = make_pools(cfg, rank, device)
            for kind, layer, t in exp_pools.tensors():
                t.copy_(initial[(kind, layer)])
            for rid, seed, tokens in args[0]:
                r = reqs[rid]
                n = -(-tokens // cfg.cache.block_size)
                place(
                    exp_pools, cfg, rank, global_state(model, tokens, cfg.cache.block_size, seed), r.blocks[:n], r.slot
                )
            conn.send(("ok", mismatches(pools, snapshot(exp_pools))))
        elif cmd == "release":
            reqs[args[0]].release()
            conn.send(("ok",))
        elif cmd == "abort":
            reqs[args[0]].abort(args[1])
            conn.send(("ok",))
        elif cmd == "remove_peer":
            ep.remove_peer(args[0], args[1])
            conn.send(("ok",))
        elif cmd == "counts":
            conn.send(("ok", (ep.blocks.num_free, ep.slots.num_free)))
        elif cmd == "stale":
            conn.send(("ok", list(ep.stale)))
        elif cmd == "incarnation":
            conn.send(("ok", reqs[args[0]].incarnation))
        elif cmd == "inject_done":  # sender: a forged late Done (stale notification)
            agent, rid, inc, fake_rank = args
            ep.transport.send_control(agent, encode_control(Done(rid, inc, ep.agent, fake_rank, 0, None)))
            conn.send(("ok",))
        else:
            conn.send(("error", f"unknown command {cmd}"))


# -- the test side -----------------------------------------------------------------------------


class Host:
    """One spawned host process and the endpoint it currently serves."""

    def __init__(self, ctx, backend: str):
        self.backend = backend
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_host_main, args=(child,), daemon=True)
        self.proc.start()
        self.spec: dict = {}
        self.meta = self.agent = self.digest = self.free0 = None

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def recv(self, timeout: float = TIMEOUT_S):
        who = f"{self.spec.get('role')} rank {self.spec.get('rank')}"
        try:
            if not self.conn.poll(timeout):
                self.proc.kill()
                raise TimeoutError(f"{who} did not answer in {timeout} s (killed)")
            msg = self.conn.recv()
        except (EOFError, OSError) as e:
            self.proc.join(5)
            raise RuntimeError(f"{who} is gone (exit code {self.proc.exitcode})") from e
        if msg[0] == "crash":
            raise RuntimeError(f"{who} crashed:\n{msg[1]}")
        if msg[0] == "error":
            raise RuntimeError(msg[1])
        return msg[1:]

    def call(self, *cmd, timeout: float = TIMEOUT_S):
        self.conn.send(cmd)
        return self.recv(timeout)

    def setup(self, spec: dict):
        self.spec = spec
        self.conn.send(("setup", spec))

    def started(self):
        self.meta, self.agent, self.digest, self.free0 = self.recv()

    def close(self) -> None:
        """Close the endpoint (keep the process); kill the process if it does not answer."""
        if not self.alive:
            return
        try:
            self.call("close", timeout=15)
        except (RuntimeError, TimeoutError):
            self.proc.kill()
            self.proc.join(5)


class HostPool:
    """Host processes per backend, reused across tests; dead ones are replaced on demand."""

    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.hosts: dict[str, list[Host]] = {}

    def take(self, backend: str, n: int) -> list[Host]:
        hosts = [h for h in self.hosts.get(backend, []) if h.alive]
        while len(hosts) < n:
            hosts.append(Host(self.ctx, backend))
        self.hosts[backend] = hosts
        return hosts[:n]

    def close(self) -> None:
        for hosts in self.hosts.values():
            for h in hosts:
                if h.alive:
                    try:
                        h.conn.send(("quit",))
                    except OSError:
                        pass
        for hosts in self.hosts.values():
            for h in hosts:
                h.proc.join(5)
                if h.alive:
                    h.proc.kill()
                    h.proc.join(5)


class Cluster:
    """a sender ranks (node P) and b receiver ranks (node D) on pooled hosts, connected to each other."""

    def __init__(self, pool: HostPool, backend: str, a: int, b: int, model: dict | None = None, **spec):
        base = dict(backend=backend, model=model or {}, **spec)
        hosts = pool.take(backend, a + b)
        self.src, self.dst = hosts[:a], hosts[a:]
        self.specs = [dict(base, role="sender", node="P", tp=a, rank=r) for r in range(a)]
        self.specs += [dict(base, role="receiver", node="D", tp=b, rank=r) for r in range(b)]

    def __enter__(self):
        try:
            for h, spec in zip(self.src + self.dst, self.specs):
                h.setup(spec)
            for h in self.src + self.dst:
                h.started()
            for h in self.src:
                h.conn.send(("peers", [q.meta for q in self.dst]))
            for h in self.dst:
                h.conn.send(("peers", [q.meta for q in self.src]))
            for h in self.src + self.dst:
                h.recv()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for h in self.src + self.dst:
            h.close()

    # -- steps -------------------------------------------------------------------------------

    def fill(self, rid: str, seed: int, tokens: int, late: int = 0):
        """late: on CUDA, write the state after a kernel that sleeps this many GPU cycles."""
        return [p.call("fill", rid, seed, tokens, late) for p in self.src]

    def reserve(self, rid: str, tokens: int, lease_s: float = 60.0) -> bytes:
        from transfer.messages import Target, TargetRank, encode_target  # noqa: PLC0415

        ranks = [msgspec.msgpack.decode(p.call("reserve", rid, tokens, lease_s)[0], type=TargetRank) for p in self.dst]
        return encode_target(Target(rid, "D", len(self.dst), self.dst[0].digest, tokens, ranks))

    def send(self, rid: str, target: bytes, tokens: int, mode: str = "all", ranks=None):
        for p in self.src if ranks is None else [self.src[r] for r in ranks]:
            p.call("send", rid, target, tokens, mode)

    def wait(self, procs, rid: str, what: str = "settled", timeout: float = 30.0):
        out = []
        for p in procs:
            ok, state, err = p.call("wait", rid, timeout, what, timeout=timeout + 30)
            assert ok, f"{p.agent}: request {rid} still {state} after {timeout} s ({err})"
            out.append((state, err))
        return out

    def counts(self, procs):
        return [tuple(p.call("counts")[0]) for p in procs]

    def assert_counts_initial(self):
        for p in self.src + self.dst:
            if p.alive:
                assert tuple(p.call("counts")[0]) == tuple(p.free0), f"{p.agent}: free counts not back to initial"
