"""Where a served request's time to first token goes, from the INFO lines a 1P+1D `pdserve up`
logs (not a test): per request the router's admission queue; on the prefill node, the wait for its
engine loop to take the request (the loop takes commands between steps) and the time in the
engine (scheduler wait, then the steps that compute the prompt, to the first token); what is left
of the router's TTFT (the handshake and reservation on the decode node before the Prefill call,
where the router logs it, then the dispatch and the first token's way back); the push; the
decode node's wait for its loop and its TTFT (from its Generate call).

    PDSERVE_BENCH_LOG=INFO python bench/served_stream.py --systems pdserve-disagg --pairs 1
    python bench/ttft_breakdown.py /tmp/served_stream-pdserve-disagg.log [--min-prompt 512]"""

from __future__ import annotations

import argparse
import re
import statistics

_ROUTER = re.compile(
    r"pdserve\.router: request (\w+): prompt (\d+).*?queue ([\d.]+) ms.*?ttft ([\d.]+) ms, tpot ([\d.]+)"
)
_RESERVE = re.compile(r"pdserve\.router: request (\w+): .*? reserve ([\d.]+) ms")
_PREFILL = re.compile(
    r"pdserve\.prefill: request (\w+): prompt \d+ .*?queue ([\d.]+) ms, prefill ([\d.]+) ms, .*? in ([\d.]+) ms"
)
_DECODE = re.compile(r"pdserve\.decode: request (\w+): prompt \d+ .*?queue ([\d.]+) ms, ttft ([\d.]+) ms")


def phases(lines, min_prompt: int) -> dict[str, list[float]]:
    """phase -> milliseconds, one per request prefilled on the prefill node (prompt >= min_prompt)."""
    router: dict[str, list[float]] = {}
    prefill: dict[str, list[float]] = {}
    decode: dict[str, list[float]] = {}
    reserve: dict[str, list[float]] = {}
    for line in lines:
        if m := _RESERVE.search(line):
            reserve[m[1]] = [float(m[2])]
        for pattern, into in ((_ROUTER, router), (_PREFILL, prefill), (_DECODE, decode)):
            if m := pattern.search(line):
                into[m[1]] = [float(x) for x in m.groups()[1:]]
                break
    out: dict[str, list[float]] = {k: [] for k in ("admission", "reserve", "prefill to loop", "prefill engine", "rest")}
    out |= {"router ttft": [], "push": [], "decode to loop": [], "decode ttft": [], "router tpot": []}
    for rid, (prompt, queue, ttft, tpot) in router.items():
        if prompt < min_prompt or rid not in prefill:
            continue
        pq, pc, push = prefill[rid]
        res = reserve.get(rid, [0.0])[0]  # 0: a log from before the router wrote it (in the rest)
        out["admission"].append(queue)
        if rid in reserve:
            out["reserve"].append(res)
        out["prefill to loop"].append(pq)
        out["prefill engine"].append(pc)
        out["rest"].append(ttft - queue - res - pq - pc)
        out["router ttft"].append(ttft)
        out["push"].append(push)
        out["router tpot"].append(tpot)
        if rid in decode:
            out["decode to loop"].append(decode[rid][0])
            out["decode ttft"].append(decode[rid][1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--min-prompt", type=int, default=512, help="leave out shorter prompts (the warm-up)")
    args = ap.parse_args()
    for path in args.logs:
        with open(path) as f:
            got = phases(f, args.min_prompt)
        print(f"{path}: {len(got['admission'])} requests; ms, p50 (p10-p90)")
        for name, xs in got.items():
            if len(xs) >= 2:
                q = statistics.quantiles(xs, n=10)
                print(f"  {name:16} {statistics.median(xs):8.1f} ({q[0]:.1f}-{q[-1]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
