"""The chat output parsers' cost per generated token (router/parsers/): a synthetic agent turn
(reasoning, then tool calls in the XML format with string, integer and object values) tokenized
by the tiny checkpoint's tokenizer and fed one token's text at a time, through the reasoning and
tool-call parsers, against the same deltas with no parser (the router's plain chat path).

    python bench/chat_parsers.py [--calls 20] [--reps 5]"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "line": {"type": "integer"}, "patch": {"type": "object"}},
            },
        },
    }
]


def turn(calls: int) -> str:
    think = "The user wants the file changed. I will read it, then edit the lines that matter.\n" * 8
    one = (
        "<tool_call>\n<function=edit_file>\n<parameter=path>\nsrc/router/parsers/output.py\n</parameter>\n"
        "<parameter=line>\n42\n</parameter>\n<parameter=patch>\n"
        '{"old": "return None", "new": "return self.calls or None"}\n</parameter>\n</function>\n</tool_call>'
    )
    return think + "</think>\n\nI will edit it now.\n" + "\n".join([one] * calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from engine.tiny_model import TinyModelSpec, make_tiny_model
    from engine.tokenizer import Tokenizer
    from router.detok import IncrementalDetokenizer
    from router.parsers.output import ChatOutput

    with tempfile.TemporaryDirectory() as d:
        tok = Tokenizer(make_tiny_model(Path(d) / "ckpt", TinyModelSpec(layers=1, hidden=64)))
    ids = tok.encode(turn(args.calls))
    det = IncrementalDetokenizer(tok)
    deltas = [det.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]

    def run(parsed: bool) -> float:
        t0 = time.perf_counter()
        out = ChatOutput("xml" if parsed else None, TOOLS, parsed, True)
        for i, s in enumerate(deltas):
            out.push(s, final=i == len(deltas) - 1)
        dt = time.perf_counter() - t0
        if parsed:
            assert len(out.message()["tool_calls"]) == args.calls
        return dt / len(deltas) * 1e6

    for parsed in (False, True):
        us = [run(parsed) for _ in range(args.reps)]
        print(
            f"{'reasoning + xml tool calls' if parsed else 'no parser (plain content)'}: {len(deltas)} tokens, "
            f"median {statistics.median(us):.2f} us/token (min {min(us):.2f}, max {max(us):.2f})"
        )


if __name__ == "__main__":
    main()
