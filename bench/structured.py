"""Structured outputs: the grammar engine's mask cost per token over a Qwen-size vocabulary
(`mask`), and constrained vs unconstrained decode throughput of the offline engine (`throughput`).

    python bench/structured.py mask [--engines llguidance,xgrammar] [--reps 3] [--max-length]
    python bench/structured.py calls [--reps 3]
    python bench/structured.py throughput [--batch 16] [--new-tokens 64] [--reps 3] [--device cpu] [--sampled]
        [--layers 2] [--hidden 256] [--max-length]

`calls`: the grammar of `tool_choice: auto` with a strict tool, over free text then a call.
`mask` walks a JSON document (a list of records under a schema with strings, enums, integers,
booleans and nested arrays) token by token through each engine's matcher: at each token, one
bitmask over 151,936 ids and the token's consumption, timed together; the tokens are chosen
from the ones llguidance allows (the longest that continues the document), so both engines see
the same tokens. xgrammar is measured where it imports (it is not a dependency).
`throughput`: a checkpoint with Qwen's vocabulary and 2 narrow layers (bf16), batch 16, every row
under a schema that cannot end within --new-tokens (so the batch stays full) against the same
rows unconstrained; tokens/s of each and the ratio."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.qwen_vocab import VOCAB, write_tokenizer  # noqa: E402


def schemas(max_length: bool) -> tuple[dict, dict]:
    """(the document's schema, the throughput rows' schema: at least 100 records, so that no row
    can finish within the measured tokens). max_length: strings with a maxLength, which costs
    llguidance an order of magnitude more per token inside them (its lexer slices, which make
    plain strings cheap, do not apply to a bounded string)."""
    bound = (lambda n: {"maxLength": n}) if max_length else (lambda n: {})
    record = {
        "type": "object",
        "properties": {
            "name": {"type": "string", **bound(24)},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "active": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", **bound(12)}, "maxItems": 4},
        },
        "required": ["name", "age", "role", "active", "tags"],
        "additionalProperties": False,
    }
    people = {"type": "array", "items": record}
    return (
        {"type": "object", "properties": {"people": people}, "required": ["people"]},
        {"type": "object", "properties": {"people": {**people, "minItems": 100}}, "required": ["people"]},
    )


DOC = json.dumps(
    {
        "people": [
            {"name": n, "age": 20 + 7 * i, "role": r, "active": i % 2 == 0, "tags": ["team" + str(i), "x"]}
            for i, (n, r) in enumerate([("Alice Moreau", "admin"), ("Bob", "viewer"), ("Chidi Okafor", "editor")] * 3)
        ]
    }
)


def _walk(tok, grammar: str) -> list[int]:
    """DOC as tokens llguidance accepts: at each step the longest allowed token that continues it."""
    import llguidance
    import torch

    from engine.structured.bitmask import unpack

    by_bytes = {tok.decode_bytes([i]): i for i in range(1, VOCAB)}
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    rest, out = DOC.encode(), []
    while rest:
        allowed = unpack(torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)[None], VOCAB)[0]
        t = next(
            by_bytes[rest[:k]]
            for k in range(min(24, len(rest)), 0, -1)
            if rest[:k] in by_bytes and allowed[by_bytes[rest[:k]]]
        )
        assert m.consume_token(t), m.get_error()
        out.append(t)
        rest = rest[len(tok.decode_bytes([t])) :]
    return out


def bench_llguidance(tok, grammar: str, tokens: list[int], reps: int) -> dict:
    import llguidance
    import torch

    t0 = time.perf_counter()
    base = llguidance.LLMatcher(tok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    bm = torch.empty((1, (VOCAB + 31) // 32), dtype=torch.int32)
    per = []
    for _ in range(reps):
        m = base.deep_copy()
        for t in tokens:
            s = time.perf_counter()
            m.unsafe_compute_mask_ptr(bm.data_ptr(), bm.numel() * 4)
            m.consume_token(t)
            per.append(time.perf_counter() - s)
    return {"compile_s": compile_s, "per_token": per}


def bench_xgrammar(hf_dir: Path, schema: dict, tokens: list[int], reps: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"), eos_token="<|endoftext|>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB)
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(schema), any_whitespace=False
    )
    compile_s = time.perf_counter() - t0
    bm = xgr.allocate_token_bitmask(1, VOCAB)
    per = []
    for _ in range(reps):
        m = xgr.GrammarMatcher(compiled)
        for t in tokens:
            s = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            ok = m.accept_token(t)
            per.append(time.perf_counter() - s)
            assert ok, t
    return {"compile_s": compile_s, "per_token": per}


def mask_main(args) -> None:
    import llguidance

    from engine.structured.grammar import grammar_text

    with tempfile.TemporaryDirectory() as d:
        tdir = write_tokenizer(Path(d))
        tok = llguidance.LLTokenizer((tdir / "tokenizer.json").read_text(), n_vocab=VOCAB, eos_token=[0])
        schema = schemas(args.max_length)[0]
        grammar = grammar_text("json_schema", json.dumps(schema))
        tokens = _walk(tok, grammar)
        print(f"document: {len(DOC)} bytes, {len(tokens)} tokens; vocabulary {VOCAB:,}")
        for name in args.engines.split(","):
            try:
                r = bench_llguidance(tok, grammar, tokens, args.reps) if name == "llguidance" else None
                if name == "xgrammar":
                    r = bench_xgrammar(tdir, schema, tokens, args.reps)
            except ImportError as e:
                print(f"{name}: not importable ({e})")
                continue
            assert r is not None, name
            us = sorted(x * 1e6 for x in r["per_token"])
            p = lambda q: us[min(len(us) - 1, int(q * len(us)))]  # noqa: E731
            print(
                f"{name}: compile {r['compile_s'] * 1e3:.1f} ms; mask + consume per token: mean "
                f"{statistics.mean(us):.1f} us, p50 {p(0.5):.1f}, p90 {p(0.9):.1f}, p99 {p(0.99):.1f}, max {us[-1]:.0f}"
            )


CALL_TEXT = "Let me run that for you now, it takes a second. " * 4
CALL = (
    "<tool_call>\n<function=run>\n<parameter=cmd>\nls -la /tmp\n</parameter>\n<parameter=n>\n3\n</parameter>\n"
    "</function>\n</tool_call>"
)


def calls_main(args) -> None:
    """The grammar of `tool_choice: auto` with a strict tool (router/tool_choice.py): free text,
    then a call under its schema; mask + consume per token over the vocabulary with Qwen's call
    tokens added as special tokens (ids 151,936 and 151,937)."""
    import llguidance
    import torch
    from tokenizers import Tokenizer

    from router.tool_choice import call_grammar

    with tempfile.TemporaryDirectory() as d:
        tok = Tokenizer.from_file(str(write_tokenizer(Path(d)) / "tokenizer.json"))
        tok.add_special_tokens(["<tool_call>", "</tool_call>"])
        n = tok.get_vocab_size()
        lt = llguidance.LLTokenizer(tok.to_str(), n_vocab=n, eos_token=[0])
    props = {"cmd": {"type": "string"}, "n": {"type": "integer"}}
    fn = {"name": "run", "parameters": {"type": "object", "properties": props, "required": ["cmd", "n"]}}
    grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar("xml", [fn], True, text_first=True))
    ids = tok.encode(CALL_TEXT + CALL, add_special_tokens=False).ids
    k = len(tok.encode(CALL_TEXT, add_special_tokens=False).ids)
    bm = torch.empty((1, (n + 31) // 32), dtype=torch.int32)
    text_us: list[float] = []
    call_us: list[float] = []
    for _ in range(args.reps):
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        for i, t in enumerate(ids):
            s = time.perf_counter()
            m.unsafe_compute_mask_ptr(bm.data_ptr(), bm.numel() * 4)
            assert m.consume_token(t), m.get_error()
            (text_us if i < k else call_us).append((time.perf_counter() - s) * 1e6)
        assert m.is_accepting()
    print(f"auto with a strict tool: {k} text tokens, then a call of {len(ids) - k}; vocabulary {n:,}")
    for name, us in (("text", text_us), ("call", call_us)):
        us.sort()
        print(
            f"  {name}: mask + consume per token p50 {us[len(us) // 2]:.1f} us, p90 {us[int(0.9 * len(us))]:.1f}, max {us[-1]:.0f}"
        )


def throughput_main(args) -> None:
    from engine import LLM, SamplingParams  # first: the engine sets OpenMP's policy before torch loads
    from engine.tiny_model import TinyModelSpec, make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        spec = TinyModelSpec(
            layers=args.layers, hidden=args.hidden, intermediate=2 * args.hidden, vocab=VOCAB, dtype="bfloat16",
            full_attention_interval=2, heads=max(4, args.hidden // 128), kv_heads=2, head_dim=128 if args.hidden > 256 else 64,
            tokenizer=False, max_positions=1024,
        )  # fmt: skip
        ckpt = make_tiny_model(Path(d) / "ckpt", spec)
        write_tokenizer(ckpt)
        (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
        llm = LLM(
            str(ckpt), dtype="bfloat16", max_num_seqs=args.batch, max_num_batched_tokens=4096,
            kv_cache_memory="512MiB", enable_prefix_caching=False, device=args.device,
        )  # fmt: skip
        prompts = [[(97 * b + 13 * i) % VOCAB for i in range(16)] for b in range(args.batch)]
        cons = {"kind": "json_schema", "value": schemas(args.max_length)[1]}
        # --sampled: Qwen's chat settings with a seed per row, as chat clients send them
        kw = [
            dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=b) if args.sampled else {}
            for b in range(args.batch)
        ]
        free = [SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, **{"temperature": 0.0, **k}) for k in kw]
        tied = [SamplingParams(max_tokens=args.new_tokens, constraint=cons, **{"temperature": 0.0, **k}) for k in kw]
        llm.generate(prompt_token_ids=prompts, sampling_params=tied)  # warm-up: compiles the grammar
        # tokens per wall second, and per CPU second of this process (all its threads, the mask
        # thread included): the second holds still on a machine shared with other work
        rates: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.reps):
            for name, params in (("unconstrained", free), ("json_schema", tied)):
                t0, c0 = time.perf_counter(), time.process_time()
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                n = sum(len(o.output_token_ids) for o in outs)
                assert all(o.finish_reason == "length" for o in outs), [o.finish_reason for o in outs]
                rates.setdefault((name, "wall"), []).append(n / dt)
                rates.setdefault((name, "cpu"), []).append(n / dc)
        llm.close()
    for clock in ("wall", "cpu"):
        for name in ("unconstrained", "json_schema"):
            r = rates[(name, clock)]
            print(f"{name}: {statistics.median(r):.0f} tokens per {clock} s (runs {', '.join(f'{x:.0f}' for x in r)})")
        ratios = [c / u for c, u in zip(rates[("json_schema", clock)], rates[("unconstrained", clock)])]
        pairs = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"{clock}: constrained / unconstrained median {statistics.median(ratios):.2f}x (pairs {pairs})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mask")
    m.add_argument("--engines", default="llguidance,xgrammar")
    m.add_argument("--reps", type=int, default=3)
    c = sub.add_parser("calls")
    c.add_argument("--reps", type=int, default=3)
    t = sub.add_parser("throughput")
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--new-tokens", type=int, default=64)
    t.add_argument("--reps", type=int, default=3)
    for p in (m, t):
        p.add_argument("--max-length", action="store_true", help="strings with a maxLength (llguidance's worst case)")
    t.add_argument("--device", default="cpu")
    t.add_argument("--sampled", action="store_true", help="Qwen's chat sampling settings, a seed per row")
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    {"mask": mask_main, "calls": calls_main, "throughput": throughput_main}[args.cmd](args)


if __name__ == "__main__":
    main()
