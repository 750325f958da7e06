"""The `pdserve` command line.

    pdserve make-tiny-model DIR [--layers 8 --hidden 256 ... --seed 0]
    pdserve demo [--model DIR] [--tp 1]
    pdserve bench-engine ...   (see bench/)

Errors print one line and exit non-zero; no stack traces.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

DEFAULT_HOME = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
DEMO_PROMPTS = [
    "Hello world! How are you today?",
    "The router picks a decode node and",
    "Hybrid language models mix linear attention layers with",
    "Once upon a time there was a small model",
]


def default_model_dir() -> Path:
    """The embedded default: a tiny random Qwen3.5 checkpoint, made on first use."""
    d = DEFAULT_HOME / "tiny-qwen3.5"
    if not (d / "config.json").is_file():
        from engine.tiny_model import make_tiny_model

        print(f"making the built-in tiny model in {d} ...", flush=True)
        make_tiny_model(d)
    return d


def _add_tiny_args(p: argparse.ArgumentParser) -> None:
    from engine.tiny_model import TinyModelSpec

    for f in fields(TinyModelSpec):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            typ = {"int": int, "float": float, "str": str}.get(str(f.type), type(f.default))
            p.add_argument(flag, type=typ, default=f.default)


def cmd_make_tiny_model(args) -> int:
    from engine.tiny_model import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(**{f.name: getattr(args, f.name) for f in fields(TinyModelSpec)})
    out = make_tiny_model(args.dir, spec)
    print(f"wrote {out} ({spec.layers} layers, hidden {spec.hidden}, vocab {spec.vocab}, seed {spec.seed})")
    return 0


def cmd_demo(args) -> int:
    from engine import LLM, SamplingParams

    model = Path(args.model) if args.model else default_model_dir()
    print(f"loading {model} (tp={args.tp}) ...", flush=True)
    with LLM(str(model), tensor_parallel_size=args.tp, dtype="float32") as llm:
        print(llm.capacity().summary())
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(DEMO_PROMPTS, sp)
        dt = time.perf_counter() - t0
        for prompt, o in zip(DEMO_PROMPTS, outs):
            print(f"\n> {prompt}\n  {o.text!r}\n  tokens {o.output_token_ids[:12]}... ({o.finish_reason})")
        n = sum(len(o.output_token_ids) for o in outs)
        print(f"\n{len(outs)} requests, {n} new tokens in {dt:.2f} s: {n / dt:.1f} tokens/s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdserve", description="Disaggregated serving for hybrid LLMs")
    ap.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG", "WARNING"))
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("make-tiny-model", help="write a small random Qwen3.5 checkpoint + tokenizer")
    p.add_argument("dir")
    _add_tiny_args(p)
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("demo", help="run the built-in tiny model on a few prompts")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.set_defaults(func=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"pdserve {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
