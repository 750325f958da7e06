"""Requests that end at their first token (classifiers: `max_tokens` 1) while long streams hold
every decode slot, through `pdserve up` 1P+1D: the classifiers' latency (median, max), the time
until all are done, and the long streams' time. Run it from each tree to compare (PYTHONPATH and
the working directory are the tree's).

    python bench/first_token_only.py --model DIR [--classifiers 24] [--prompt 1000] [--streams 4]
        [--queued 0] [--stream-tokens 1500] [--max-tokens 1] [--tree PATH]

--queued N sends N more long streams than there are slots: they wait for decode room at the head
of the router's queue, in front of the classifiers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _post(base: str, body: dict) -> float:
    req = urllib.request.Request(base + "/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.monotonic()
    with urllib.request.urlopen(req, timeout=600) as r:
        json.loads(r.read())
    return time.monotonic() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose pdserve runs")
    ap.add_argument("--classifiers", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=1000, help="prompt tokens of each classifier")
    ap.add_argument("--streams", type=int, default=4, help="long streams (and the decode node's --max-num-seqs)")
    ap.add_argument("--queued", type=int, default=0, help="more long streams, waiting for a slot")
    ap.add_argument("--stream-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=1, help="of the classifiers")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "router.cli", "up", "--model", args.model, "--port", "0", "--http-port", "0"]
    cmd += ["--prefill", "1", "--decode", "1", "--max-num-seqs", str(args.streams), "--local-prefill-threshold", "0"]
    cmd += ["--dtype", "bfloat16"]
    if args.queued:  # the queued streams wait as long as it takes (their estimate passes the default budget)
        cmd += ["--admission-timeout", "0"]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": args.tree, "PDSERVE_LOG": "INFO"}
    up = subprocess.Popen(cmd, cwd=args.tree, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base, name = None, None
        deadline = time.monotonic() + 300
        while name is None:
            if up.poll() is not None or time.monotonic() > deadline:
                print(f"pdserve up did not become ready (log {log.name})")
                return 1
            text = Path(log.name).read_text()
            m = re.search(r"OpenAI-compatible HTTP on (http://\S+/v1)", text)
            base = m.group(1) if m else None
            try:
                models = json.loads(urllib.request.urlopen(base + "/models").read())["data"] if base else []
                name = models[0]["id"] if models else None
            except OSError:
                pass
            time.sleep(0.5)
        assert base is not None
        ignore = {"ignore_eos": True, "temperature": 0.0}
        longs = [
            {"model": name, "prompt": [5 + i] * 20, "max_tokens": args.stream_tokens, **ignore}
            for i in range(args.streams + args.queued)
        ]
        ask = {"max_tokens": args.max_tokens, "temperature": 0.0}
        cls = [
            {"model": name, "prompt": [(7 * k + j) % 1000 for j in range(args.prompt)], **ask}
            for k in range(args.classifiers)
        ]
        _post(base, {"model": name, "prompt": [1, 2, 3], "max_tokens": 2})  # warm
        with ThreadPoolExecutor(args.streams + args.queued + 8) as ex:
            running = [ex.submit(_post, base, b) for b in longs]
            time.sleep(1.0)  # the streams hold the decode slots
            t0 = time.monotonic()
            lat = list(ex.map(lambda b: _post(base, b), cls))
            wall = time.monotonic() - t0
            stream_s = [f.result() for f in running]
    finally:
        up.terminate()
        up.wait(120)
    out = {
        "tree": args.tree,
        "classifier_median_s": round(statistics.median(lat), 3),
        "classifier_max_s": round(max(lat), 3),
        "classifiers_done_s": round(wall, 2),
        "streams_median_s": round(statistics.median(stream_s), 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
