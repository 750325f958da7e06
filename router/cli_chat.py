"""`pdserve generate --chat`: the prompt as a user message (after `--system`; `--image` parts before
its text, files sent as data: URLs), sent through the
SDK's `Client.chat_stream` so the router applies the checkpoint's chat template; the reasoning
streams to stderr, the answer to stdout, then its tool calls (one JSON object a line) and one
line of totals."""

from __future__ import annotations

import base64
import json
import mimetypes
import sys
import time
from pathlib import Path


def image_url(x: str) -> str:
    """A chat image part's URL: a URL as it is, a file as a data: URL (its type from its name)."""
    if "://" in x or x.startswith("data:"):
        return x
    kind = mimetypes.guess_type(x)[0] or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(Path(x).read_bytes()).decode()}"


def run_chat(c, args, sampling: dict, echo) -> None:
    """echo: router.cli_client.Echo, which ends a line left open when an error follows."""
    from client import ChatResult

    msgs = [{"role": "system", "content": args.system}] if args.system else []
    if args.image:  # image parts (files as data: URLs), then the text, as an OpenAI client writes them
        parts: list[dict] = [{"type": "image_url", "image_url": {"url": image_url(x)}} for x in args.image]
        msgs.append({"role": "user", "content": [*parts, {"type": "text", "text": args.prompt}]})
    else:
        msgs.append({"role": "user", "content": args.prompt})
    names = ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos")
    fields = {k: sampling[k] for k in names if sampling.get(k) is not None}
    for k in ("top_k", "ignore_eos"):  # their defaults, not sent
        if not fields.get(k):
            fields.pop(k, None)
    if args.no_thinking:
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    t0, first, res = time.monotonic(), None, ChatResult()
    for chunk in c.chat_stream(msgs, **fields):
        res.add(chunk)
        d = chunk.get("delta") or {}
        first = first or (time.monotonic() if d else None)
        if d.get("reasoning_content"):
            echo(d["reasoning_content"], sys.stderr)
        if d.get("content"):
            echo(d["content"])
    for call in res.message.get("tool_calls") or ():
        print("\n" + json.dumps(call), end="")
    ttft = f"{(first - t0) * 1e3:.1f} ms" if first else "-"
    u, fin = res.usage, res.choices[0].finish_reason if res.choices else None
    print(
        f"\n[{u.get('prompt_tokens', 0)} prompt tokens, {u.get('completion_tokens', 0)} new, {fin}; TTFT {ttft}]",
        file=sys.stderr,
    )
