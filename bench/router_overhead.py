"""What the OpenAI HTTP front adds over gRPC per request (not a test): the same short requests,
alternately through the SDK and `POST /v1/completions`, against one `pdserve up`; p50 / p90 of each.

    flock /tmp/pdserve-bench.lock python bench/router_overhead.py [--requests 300] [--prefill 0]"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=300, help="per front end")
    ap.add_argument("--prefill", type=int, default=0, help="prefill nodes (0: the decode node prefills)")
    args = ap.parse_args()

    from client import Client
    from router.cli import default_model_dir
    from router.launch import Cluster, PoolSpec

    model = Path(args.model) if args.model else default_model_dir()
    http_port = free_port()
    spec = PoolSpec(
        model=str(model),
        prefill=args.prefill,
        decode=1,
        port=0,
        log_level="WARNING",
        node_options={"dtype": "float32"},
        router_options={"http_port": http_port},
    )
    prompt = list(range(100, 116))
    with Cluster(spec, out=sys.stderr) as cl:
        cl.start()
        with Client(cl.address, timeout=60) as c:
            c.wait_ready(timeout=60)
            conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as gRPC's own sockets do
            conn.request("GET", "/v1/models")
            name = json.loads(conn.getresponse().read())["data"][0]["id"]

            def grpc_once(n: int) -> list[int]:
                return c.generate(prompt_token_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True).token_ids

            def http_once(n: int) -> str:
                body = json.dumps(
                    {"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
                )
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                data = r.read()
                assert r.status == 200, data
                return json.loads(data)["choices"][0]["text"]

            for n in range(1, 5):  # warm-up; both paths give the same text
                want = c.generate(prompt_token_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True).text
                assert http_once(n) == want and len(grpc_once(n)) == n
            lat: dict[str, list[float]] = {"grpc": [], "http": []}
            for i in range(args.requests):
                n = 1 + i % 4
                for kind, fn in (("grpc", grpc_once), ("http", http_once))[:: 1 if i % 2 else -1]:
                    t0 = time.perf_counter()
                    fn(n)
                    lat[kind].append(time.perf_counter() - t0)
            conn.close()
    print(
        f"\n{args.requests} requests per front end, one at a time, 16-token prompt, max_tokens 1..4; "
        f"{args.prefill} prefill + 1 decode node; model {model}\n"
    )
    for kind, xs in lat.items():
        print(
            f"{kind:<5} p50 {pct(xs, 50) * 1e3:7.2f} ms   p90 {pct(xs, 90) * 1e3:7.2f} ms   "
            f"mean {statistics.mean(xs) * 1e3:7.2f} ms"
        )
    d50 = pct(lat["http"], 50) - pct(lat["grpc"], 50)
    print(f"\nHTTP - gRPC at p50: {d50 * 1e3:+.2f} ms ({pct(lat['http'], 50) / pct(lat['grpc'], 50):.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
