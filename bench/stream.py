"""KV streamed per prefill chunk (benchmark, not a test): the decode node's wait between the first
token and the state being in (its second token can start), single push vs streamed per chunk vs
streamed with the last chunk posted layer by layer, on the rank processes of bench/transfer.py
(NIXL, each rank its own process, TP a -> 1).

The prefill side runs a prompt in chunks of --chunk tokens; a sleep of --chunk-ms stands in for
each chunk's forward (the engine's compute is not what is measured here, and the ranks' pools are
written by no model), the rank polls its endpoint once per chunk as an engine does once per step.
Single push: everything is written once the last chunk finished. Streamed: each chunk's full
pages are written as it finishes (`SendRequest.post_pages`), the rest (last chunk, partial page,
GDN state) once the last finished. Per layer: streamed, and the last chunk's sleep is split over
the model's layers with each layer's rest (its pages of the chunk, its GDN state) posted after
its share (`SendRequest.post(layers=...)`, what the engine's layer connector does); the final post
then carries only Done. The wait is from the end of the last chunk (the first token) to the
destination rank seeing every Done; the prefill side's time is from its first chunk to the first
token (where the posts' own cost shows, when the backend copies in the posting thread).

    python bench/stream.py [--tokens 4096 16384 32768] [--chunk 2048] [--chunk-ms 50] [--tp 1]
        [--reps 3] [--shape 35b-a3b] [--device cpu] [--rx-poll-ms 0]

The destination rank polls its endpoint busily by default; over TCP its UCX reads the socket only
when polled, so `--rx-poll-ms 4` shows the wait of a decode node whose idle loop polls every 4 ms."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.transfer import SHAPES, Ranks  # noqa: E402

MODES = ("single", "chunks", "layers")


def one(
    ranks: Ranks, rid: str, tokens: int, chunk: int, chunk_s: float, mode: str, rx_poll_s: float = 0.0
) -> tuple[float, float, int]:
    """(wait after the first token, prefill time, bytes) of one request; the destination polls
    its endpoint every rx_poll_s (0: busy)."""
    from transfer.messages import Target, encode_target  # noqa: PLC0415

    tr = ranks.call(ranks.dst, "reserve", rid, tokens)
    target = encode_target(Target(rid, "D", 1, ranks.digest, tokens, [tr]))
    for c in ranks.src:
        ranks.call(c, "open", rid, target, tokens)  # Begin and grants: before the first chunk
    assert ranks.call(ranks.dst, "wait_done", rid, rx_poll_s) == "ready"
    for c in ranks.src:
        c.send(("stream", rid, chunk, chunk_s, mode))
    res = [ranks._recv(c) for c in ranks.src]
    t_ready = ranks._recv(ranks.dst)
    t_first = max(r[1] for r in res)
    return t_ready - t_first, t_first - min(r[0] for r in res), sum(r[2] for r in res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (--max-num-batched-tokens)")
    ap.add_argument("--chunk-ms", type=float, default=50.0, help="the stand-in for one chunk's forward")
    ap.add_argument("--tp", type=int, default=1, help="source TP size (destination TP is 1)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shape", default="35b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--rx-poll-ms",
        type=float,
        default=0.0,
        help="the destination polls every this many ms (0: busy; an idle decode node's loop: 1 doubling to 4)",
    )
    args = ap.parse_args()
    ranks = Ranks(args.tp, max(args.tokens), "nixl", device=args.device, shape=args.shape)
    rows = []
    try:
        for tokens in args.tokens:
            one(ranks, f"warm-{tokens}", tokens, args.chunk, 0.0, "layers")  # first touch of the pages
            got: dict[str, list[tuple[float, float, int]]] = {m: [] for m in MODES}
            for i in range(args.reps):  # interleaved, so load drift hits every mode alike
                for mode in MODES:
                    rid = f"r{tokens}-{i}-{mode}"
                    got[mode].append(
                        one(ranks, rid, tokens, args.chunk, args.chunk_ms / 1e3, mode, args.rx_poll_ms / 1e3)
                    )
            med = {s: [statistics.median(x[k] for x in got[s]) for k in range(3)] for s in got}
            rows.append((tokens, med))
            print(_fmt(tokens, med), flush=True)
    finally:
        ranks.close()
    print()
    print(
        f"shape {args.shape}, TP {args.tp}->1, memory on {args.device}, chunk {args.chunk} tokens, "
        f"{args.chunk_ms:g} ms per chunk (stand-in), destination polling "
        f"{f'every {args.rx_poll_ms:g} ms' if args.rx_poll_ms else 'busily'}, medians of {args.reps}"
    )
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|")
    for tokens, med in rows:
        print(_fmt(tokens, med))


HEADER = (
    "| tokens | MB | wait: single push | streamed | per layer (ms) | prefill side: single | streamed | per layer (ms) |"
)


def _fmt(tokens: int, med: dict) -> str:
    waits = " | ".join(f"{med[m][0] * 1e3:.1f}" for m in MODES)
    prefill = " | ".join(f"{med[m][1] * 1e3:.0f}" for m in MODES)
    return f"| {tokens} | {med['single'][2] / 1e6:.1f} | {waits} | {prefill} |"


if __name__ == "__main__":
    main()
