"""How many streamed tokens one router process relays (not a test): a fake decode node (a grpc.aio
server in its own process that streams every request's tokens as fast as it can, one per message)
registered with a real `pdserve router` process, and this process as the client holding
`--streams` streams at once, through gRPC (`Generation.Generate`) and through the OpenAI HTTP API
(`POST /v1/completions`, streamed). Prints tokens per second and the router's CPU time per token
(from /proc, so the figure does not count the client's or the fake node's CPU).

    flock /tmp/pdserve-bench.lock python bench/router_capacity.py [--streams 256] [--tokens 64] [--rounds 2]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENS: list[int] = []  # what the fake node streams, in turn: ids that decode to whole words


def word_ids(model: Path, n: int = 64) -> list[int]:
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(model)
    ids = [i for i in range(50, 5000) if (s := tok.decode([i])).strip().isalpha() and len(s) >= 2]
    return ids[:n]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        cols = f.read().rsplit(")", 1)[1].split()
    return (int(cols[11]) + int(cols[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the fake decode node (its own process) ------------------------------------------------------
async def fake_node(router: str, vocab: int) -> None:
    import grpc

    from proto import pb, rpc
    from serving.rpc import Heartbeater

    class Node(rpc.DecodeNodeServicer):
        async def Generate(self, request, context):
            n = request.sampling.max_tokens
            for i in range(n):
                yield pb.GenerateResponse(
                    token_ids=[TOKENS[i % len(TOKENS)]], finish_reason="length" if i == n - 1 else ""
                )

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    rpc.add_DecodeNodeServicer_to_server(Node(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cap = pb.Capacity(total_blocks=1 << 20, free_blocks=1 << 20, block_size=16, total_slots=4096, free_slots=4096)
    info = pb.NodeInfo(
        node_id="fake-decode",
        kind=pb.NODE_KIND_DECODE,
        address=f"127.0.0.1:{port}",
        incarnation=1,
        model="fake",
        vocab_size=vocab,
        max_model_len=4096,
        capacity=cap,
    )
    Heartbeater(router, lambda: info, 0.5).start()
    print("fake node ready", flush=True)
    await server.wait_for_termination()


# ---- the client (this process) -------------------------------------------------------------------
async def grpc_round(addr: str, streams: int, tokens: int) -> int:
    import grpc

    from proto import pb, rpc

    async with grpc.aio.insecure_channel(addr) as ch:
        stub = rpc.GenerationStub(ch)
        sp = pb.SamplingParams(max_tokens=tokens, ignore_eos=True)

        async def one(i: int) -> int:
            got = 0
            async for m in stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3, 4 + i % 50], sampling=sp)):
                got += len(m.token_ids)
            return got

        return sum(await asyncio.gather(*(one(i) for i in range(streams))))


async def http_round(port: int, streams: int, tokens: int) -> int:
    async def one(i: int) -> int:
        body = json.dumps(
            {"model": "fake", "prompt": [1, 2, 3, 4 + i % 50], "max_tokens": tokens, "stream": True, "ignore_eos": True}
        ).encode()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        raw = await r.read()  # until the router closes the connection
        w.close()
        # one event per token: each streamed token is a whole word of the tokenizer (TOKENS)
        return sum(1 for ev in raw.split(b"data: ")[1:] if b'"text": "' in ev and b'"text": ""' not in ev)

    return sum(await asyncio.gather(*(one(i) for i in range(streams))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per front end, alternated")
    ap.add_argument("--profile", default=None, help="run the router under cProfile, its stats written here")
    ap.add_argument("--fake-node", default=None, help=argparse.SUPPRESS)  # internal: run the fake node
    ap.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from router.cli import default_model_dir

    model = default_model_dir()
    TOKENS.extend(word_ids(model))
    if args.fake_node:
        asyncio.run(fake_node(args.fake_node, args.vocab))
        return 0

    vocab = (
        json.loads((model / "config.json").read_text()).get("vocab_size")
        or json.loads((model / "config.json").read_text())["text_config"]["vocab_size"]
    )
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN"}
    env["PYTHONPATH"] = str(ROOT)
    http_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
        opts = {"--port": "0", "--port-file": str(port_file), "--http-port": str(http_port), "--model": str(model)}
        cmd = [sys.executable, *prof, "-m", "router.cli", "--log-level", "WARNING", "router"]
        router = subprocess.Popen(
            [*cmd, *(x for kv in opts.items() for x in kv), "--insecure-open-cluster"], env=env, cwd=ROOT
        )
        node = None
        try:
            while not (port_file.is_file() and port_file.read_text()):
                time.sleep(0.05)
            addr = f"127.0.0.1:{int(port_file.read_text())}"
            fake = [sys.executable, __file__, "--fake-node", addr, "--vocab", str(vocab)]
            node = subprocess.Popen(fake, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
            assert node.stdout is not None and "ready" in node.stdout.readline()
            time.sleep(1.5)  # registered
            asyncio.run(grpc_round(addr, 8, 4))  # warm both paths
            asyncio.run(http_round(http_port, 8, 4))
            print(f"{args.streams} streams x {args.tokens} tokens; load {os.getloadavg()[0]:.2f} (1 min)")
            for rnd in range(args.rounds):
                for front in ("grpc", "http"):
                    c0, n0, t0 = cpu_s(router.pid), cpu_s(node.pid), time.monotonic()
                    if front == "grpc":
                        got = asyncio.run(grpc_round(addr, args.streams, args.tokens))
                    else:
                        got = asyncio.run(http_round(http_port, args.streams, args.tokens))
                    wall, rcpu, ncpu = time.monotonic() - t0, cpu_s(router.pid) - c0, cpu_s(node.pid) - n0
                    want = args.streams * args.tokens
                    print(
                        f"round {rnd} {front:4s}: {got}/{want} tokens in {wall:.2f} s = {got / wall:,.0f} tokens/s; "
                        f"router CPU {rcpu:.2f} s = {rcpu / max(got, 1) * 1e6:.1f} us/token "
                        f"({rcpu / wall:.0%} of a core); fake node CPU {ncpu:.2f} s",
                        flush=True,
                    )
        finally:
            for p in (node, router):
                if p is not None:
                    p.terminate()
                    p.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
