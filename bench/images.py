"""Images in the offline engine: a mixed text / image workload on a tiny vision-language
checkpoint (engine/tiny_model.py --vision), every image distinct or a few repeated (the encoder
cache and the prefix cache then serve the repeats). TTFT p50 of text and image requests, output
tokens per second, and the share of the step time spent in the image processor + encoder.

    python bench/images.py [--requests 32] [--image-share 0.5] [--size 256x192] [--distinct 0]
                           [--vision-depth 2 --vision-hidden 64] [--text 64] [--reply 32]"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path.pop(0)  # bench/kernels.py would shadow the kernels package
sys.path.insert(0, str(ROOT))

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as engine/__init__.py, which loads after torch here

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import TinyModelSpec  # noqa: E402
from tests.helpers import vl_ckpt as vc  # noqa: E402


def workload(path: str, args) -> list[tuple[list[int], list]]:
    """(prompt, images) per request: a user turn of --text words, with one image of --size in
    --image-share of them (image k of --distinct when > 0, else every image its own)."""
    w, h = (int(x) for x in args.size.split("x"))
    words = " ".join(["the quick brown fox jumps over the lazy dog"] * (args.text // 9 + 1)).split()[: args.text]
    out = []
    for i in range(args.requests):
        text = f"{i}: " + " ".join(words)
        if (i * args.image_share) % 1 + args.image_share >= 1 and args.image_share > 0:
            seed = i % args.distinct if args.distinct else i
            out.append(vc.chat(path, [vc.user(None, text)], [vc.png(w, h, seed)]))
        else:
            out.append(vc.chat(path, [vc.user(text)], []))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--image-share", type=float, default=0.5)
    ap.add_argument("--size", default="256x192")
    ap.add_argument("--distinct", type=int, default=0, help="images cycle over this many (0: all distinct)")
    ap.add_argument("--text", type=int, default=64, help="words of text per request")
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--vision-depth", type=int, default=2)
    ap.add_argument("--vision-hidden", type=int, default=64)
    ap.add_argument("--max-pixels", type=int, default=256 * 256)
    ap.add_argument("--model", default=None, help="a vision-language checkpoint (default: a tiny one made here)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or vc.make(
            Path(tmp) / "vl",
            TinyModelSpec(
                layers=8,
                vision=True,
                vision_depth=args.vision_depth,
                vision_hidden=args.vision_hidden,
                vision_heads=max(1, args.vision_hidden // 16),
                vision_intermediate=4 * args.vision_hidden,
                max_pixels=args.max_pixels,
            ),
        )
        reqs = workload(path, args)
        sp = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
        with LLM(path, dtype="float32", engine_process=False) as llm:
            llm.generate(prompt_token_ids=[reqs[0][0]], images=[reqs[0][1]], sampling_params=sp)  # warm up
            eng = llm.engine
            before = eng.image_totals
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=[r[0] for r in reqs], images=[r[1] for r in reqs], sampling_params=sp)
            wall = time.perf_counter() - t0
            n_img, enc_s, hits = (a - b for a, b in zip(eng.image_totals, before))
    ttft = {k: [o.metrics["ttft_s"] for o, r in zip(outs, reqs) if bool(r[1]) == k] for k in (False, True)}
    n_tok = sum(len(o.output_token_ids) for o in outs)
    img_tokens = sum(i.num_tokens(2) for _, imgs in reqs for i in imgs)
    print(
        f"{args.requests} requests ({len(ttft[True])} with a {args.size} image, {img_tokens} image tokens), "
        f"reply {args.reply}: wall {wall:.2f} s, {n_tok / wall:.0f} output tok/s; TTFT p50 text "
        f"{statistics.median(ttft[False]) * 1e3 if ttft[False] else float('nan'):.0f} ms, image "
        f"{statistics.median(ttft[True]) * 1e3 if ttft[True] else float('nan'):.0f} ms; encoder {int(n_img)} images "
        f"{enc_s:.2f} s ({enc_s / wall:.0%} of wall), encoder-cache hits {int(hits)}; "
        f"cached prompt tokens {sum(o.num_cached_tokens for o in outs)}"
    )


if __name__ == "__main__":
    main()
