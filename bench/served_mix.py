"""A mixed OpenAI workload against `pdserve up` (not a test; it looks for what breaks): chat with
tools (`required`, `auto`), JSON schemas, `n` > 1, logprobs, streams with usage, stop strings,
client disconnects mid-stream, agents' multi-turn loops with tool results, vLLM's fields
(`structured_outputs` choice, `return_token_ids`, `skip_special_tokens`; checked), Anthropic's
`/v1/messages` streamed with a required tool call (its events and the call's input checked),
`thinking_token_budget` (the reasoning tokens checked against it), `auto` with a strict tool and
a custom tool's grammar (their calls checked against the schema and the regex),
thinking on and off,
sampled and greedy, prompts from a few tokens to past `--max-model-len` sharing long system
prefixes, and images when the checkpoint takes them.
Reports the answers by status, the node exits and the WARNING / ERROR lines of the cluster's log,
and whether every KV page and state slot is back once the load is gone. Exit status 1 when a node
exited, an answer was a 5xx, or memory was not back.

    python bench/served_mix.py --make qwen3_5_moe --mtp --fp8 -- --decode-tp 2 --dtype bfloat16 \
        --speculative-method mtp --num-speculative-tokens 2
    python bench/served_mix.py --model DIR --requests 300 --concurrency 32 -- --prefill-tp 2

Everything after `--` goes to `pdserve up` as it is. A crash it found (a CPU GEMM over no rows on
two threads, SIGILL) is in tests/kernels/test_cpu_ops_boundary.py."""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "run a command",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}, "n": {"type": "integer"}, "mode": {"enum": ["a", "b"]}},
                "required": ["cmd", "n"],
            },
        },
    }
]
SCHEMA = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}},
}


CHOICES = ["alpha", "beta gamma", "delta"]
STRICT = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]  # type: ignore[dict-item]
PATCH = r"(add|del) [a-z]{1,8}\.py"
CUSTOM = [
    {
        "type": "custom",
        "custom": {"name": "patch", "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": PATCH}}},
    }
]


def _calls_kept(kind: str, code: int, text: str) -> tuple[int, str]:
    """A strict-auto call whose arguments miss the schema, or a custom call whose input is not in
    its grammar, as a 5xx, so the run fails."""
    if code != 200:
        return code, text
    for c in json.loads(text)["choices"]:
        if c["finish_reason"] == "length":
            continue  # a call cut off is incomplete by right
        for call in c["message"].get("tool_calls") or ():
            if kind == "custom-tool":
                if call["type"] != "custom" or not re.fullmatch(PATCH, call["custom"]["input"]):
                    return 599, "custom tool input outside its grammar: " + json.dumps(call)[:300]
                continue
            args = json.loads(call["function"]["arguments"])
            if not isinstance(args.get("cmd"), str) or not isinstance(args.get("n"), int):
                return 599, "strict tool call misses its schema: " + json.dumps(call)[:300]
    return code, text


def _checked(code: int, text: str) -> tuple[int, str]:
    """A vllm-fields answer that broke its promise (content outside the choices, no token ids) as
    a 5xx, so the run fails."""
    if code != 200:
        return code, text
    body = json.loads(text)
    c = body["choices"][0]
    ids = c.get("token_ids")
    if not body.get("prompt_token_ids") or ids is None or len(ids) != body["usage"]["completion_tokens"]:
        return 599, "return_token_ids: ids missing or not the completion's " + text[:300]
    # skip_special_tokens false: the EOS that ended it shows (<|im_end|> or <|endoftext|>)
    said = re.sub(r"(<\|[a-z_]+\|>)+$", "", c["message"].get("content") or "")
    if c["finish_reason"] == "stop" and said.strip() not in CHOICES:
        return 599, "structured_outputs choice not followed: " + json.dumps(c)[:600]
    return code, text


def _post(base: str, path: str, body: dict, timeout: float) -> tuple[int, str]:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except Exception as e:  # a timeout of ours is a disconnect: the server must cancel the request
        return -1, type(e).__name__


def _disconnect(base: str, body: dict) -> tuple[int, str]:
    """Open a stream, read a little of it, hang up."""
    req = urllib.request.Request(
        base + "/chat/completions", json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read(400)
        return 0, "disconnected"
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except Exception as e:
        return -1, type(e).__name__


def _agent(base: str, body: dict, turns: int = 3) -> tuple[int, str]:
    """An agent's loop: each turn sends the conversation so far, the assistant's last answer (its
    tool calls when it made some) and a tool result after it, so every turn after the first
    repeats a growing prefix (the decode node's own cache, or the prefill pool's). The last
    turn's answer, or the first that failed."""
    msgs = list(body["messages"])  # type: ignore[arg-type]
    code, text = 0, ""
    for t in range(turns):
        code, text = _post(base, "/chat/completions", {**body, "messages": msgs}, 900)
        if code != 200:
            return code, text
        choice = json.loads(text)["choices"][0]
        if choice["finish_reason"] == "length":  # a call cut by max_tokens is no call to run
            return code, text
        said = choice["message"]
        calls = said.get("tool_calls") or []
        turn: dict[str, object] = {"role": "assistant", "content": said.get("content") or ""}
        if calls:
            turn["tool_calls"] = calls
        msgs.append(turn)
        for c in calls:
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": f"result {t}: " + "ok " * 40})
        if not calls:
            msgs.append({"role": "user", "content": f"and then step {t + 1}?"})
        body = {**body, "tool_choice": "auto"}
    return code, text


def _anthropic(root: str, body: dict) -> tuple[int, str]:
    """The same request as Anthropic's Messages API, streamed, with a required call of the tool:
    599 when the stream does not end with message_stop or a tool_use's input is no JSON object."""
    msgs: list = body["messages"]  # type: ignore[assignment]
    user = msgs[-1]["content"]
    if isinstance(user, list):
        user = [
            {"type": "text", "text": p["text"]}
            if p["type"] == "text"
            else {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": p["image_url"]["url"].split(",", 1)[1]},
            }
            for p in user
        ]
    fn: dict = TOOLS[0]["function"]  # type: ignore[assignment]
    a: dict[str, object] = {
        "model": body["model"],
        "max_tokens": max(1, int(body["max_tokens"])),  # type: ignore[call-overload]
        "messages": [{"role": "user", "content": user}],
        "stream": True,
        "tools": [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}],
        "tool_choice": {"type": "any"},
        "thinking": {"type": "enabled" if body["chat_template_kwargs"]["enable_thinking"] else "disabled"},  # type: ignore[index]
    }
    if msgs[0]["role"] == "system":
        a["system"] = msgs[0]["content"]
    for k in ("temperature", "top_p", "top_k", "seed"):
        if k in body:
            a[k] = body[k]
    code, text = _post(root, "/v1/messages", a, 900)
    if code != 200:
        return code, text
    events = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: ")]
    if not events or events[-1]["type"] != "message_stop":
        return 599, "anthropic stream did not end with message_stop: " + text[-300:]
    reason = next(e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta")
    args: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
            args[e["index"]] = ""
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            args[e["index"]] += e["delta"]["partial_json"]
    if reason == "tool_use":
        try:
            ok = bool(args) and all(isinstance(json.loads(v), dict) for v in args.values())
        except ValueError:
            ok = False
        if not ok:
            return 599, "anthropic tool_use input is no JSON object: " + json.dumps(args)[:300]
    return code, text


def _images(k: int) -> list[str]:
    import numpy as np
    from PIL import Image

    out = []
    for i in range(k):
        g = np.random.default_rng(i)
        px = g.integers(0, 255, (int(g.choice([32, 64, 120])), int(g.choice([32, 90, 200])), 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, format="PNG")
        out.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return out


def _request(
    i: int, model: str, systems: list[str], images: list[str], long_words: int
) -> tuple[str, dict[str, object]]:
    """(kind, body) of request i: a seeded draw over the mix the module docstring lists."""
    rnd = random.Random(i)

    def words(n: int) -> str:
        return " ".join(f"w{rnd.randint(0, 150000)}" for _ in range(n))

    user: object = words(rnd.randint(3, 200))
    if images and rnd.random() < 0.3:
        user = [{"type": "text", "text": words(5)}] + [
            {"type": "image_url", "image_url": {"url": rnd.choice(images)}} for _ in range(rnd.randint(1, 3))
        ]
    msgs = [{"role": "system", "content": rnd.choice(systems)}, {"role": "user", "content": user}]
    if rnd.random() < 0.08:
        msgs = [{"role": "user", "content": words(rnd.randint(long_words // 2, long_words))}]
    body: dict[str, object] = {"model": model, "messages": msgs, "max_tokens": rnd.randint(1, 120)}
    body["chat_template_kwargs"] = {"enable_thinking": rnd.random() < 0.5}
    if rnd.random() < 0.6:
        body.update(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=i)
    else:
        body["temperature"] = 0.0
    q = rnd.random()
    kinds: list[tuple[float, str, dict[str, object]]] = [
        (0.12, "tools-required", dict(tools=TOOLS, tool_choice="required")),
        (0.18, "tools-auto", dict(tools=TOOLS)),
        (
            0.28,
            "json-schema",
            dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}),
        ),
        (0.36, "n3", dict(n=3)),
        (0.44, "logprobs", dict(logprobs=True, top_logprobs=5)),
        (0.50, "stop-stream", dict(stop=["w1", "w2"], stream=True)),
        (0.56, "max0", dict(max_tokens=0)),
        (0.66, "stream-usage", dict(stream=True, stream_options={"include_usage": True})),
        (0.74, "disconnect", dict(max_tokens=400)),
        (0.82, "agent", dict(tools=TOOLS, tool_choice="required", max_tokens=400)),
        (
            0.88,
            "vllm-fields",
            dict(structured_outputs={"choice": CHOICES}, return_token_ids=True, skip_special_tokens=False),
        ),
        (0.91, "anthropic", {}),
        (0.94, "think-budget", dict(thinking_token_budget=rnd.randint(0, 40), max_tokens=rnd.randint(40, 160))),
        (0.965, "strict-auto", dict(tools=STRICT, max_tokens=rnd.randint(60, 200))),
        (0.985, "custom-tool", dict(tools=CUSTOM, tool_choice="required", max_tokens=200)),
    ]
    for upto, kind, extra in kinds:
        if q < upto:
            body.update(extra)
            return kind, body
    return "plain", body


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def main() -> int:
    argv = sys.argv[1:]
    up_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a checkpoint directory (else --make writes one)")
    ap.add_argument("--make", default="qwen3_5_moe", help="the tiny checkpoint's architecture (without --model)")
    ap.add_argument("--mtp", action="store_true", help="the tiny checkpoint gets an MTP block")
    ap.add_argument("--fp8", action="store_true", help="the tiny checkpoint is block-FP8")
    ap.add_argument("--vision", action="store_true", help="the tiny checkpoint is vision-language")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="served-mix-"))
    model = args.model
    if model is None:
        model = str(work / "ckpt")
        make = [sys.executable, "-m", "router.cli", "make-tiny-model", model, "--arch", args.make, "--vocab", "151936"]
        make += ["--experts", "6", "--top-k", "3"] if args.make != "qwen3_5" else []
        make += [f"--{f}" for f in ("mtp", "fp8", "vision") if getattr(args, f)]
        subprocess.run(make, cwd=ROOT, check=True, capture_output=True)
    log_path = work / "up.log"
    cmd = [sys.executable, "-m", "router.cli", "up", "--model", model, "--port", "0", "--http-port", "0"]
    cmd += ["--max-model-len", str(args.max_model_len), *up_args]
    print(f"served_mix: pdserve up {' '.join(cmd[4:])} (log {log_path})", flush=True)
    with open(log_path, "w") as log:
        up = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = None
        deadline = time.monotonic() + 600
        while base is None or "pdserve up: ready" not in log_path.read_text():
            text = log_path.read_text()
            m = re.search(r"OpenAI-compatible HTTP on (http://\S+/v1)", text)
            base = m.group(1) if m else None
            if up.poll() is not None or time.monotonic() > deadline:
                print(text[-3000:])
                print("served_mix: pdserve up did not become ready")
                return 1
            time.sleep(0.5)
        assert base is not None
        name = json.loads(urllib.request.urlopen(base + "/models").read())["data"][0]["id"]
        rnd = random.Random(args.seed)
        systems = [" ".join(f"w{rnd.randint(0, 150000)}" for _ in range(n)) for n in (60, 300, 700)]
        images = _images(6) if args.vision else []
        long_words = args.max_model_len // 4  # about 5 tokens a word: some prompts pass the context

        def one(i: int) -> tuple[str, int, str]:
            kind, body = _request(args.seed * 100_000 + i, name, systems, images, long_words)
            if kind == "disconnect":
                code, text = _disconnect(base, body)
            elif kind == "agent":
                code, text = _agent(base, body)
            elif kind == "anthropic":
                code, text = _anthropic(base.removesuffix("/v1"), body)
            else:
                code, text = _post(base, "/chat/completions", body, 900)
            if kind == "vllm-fields":
                code, text = _checked(code, text)
            if kind in ("strict-auto", "custom-tool"):
                code, text = _calls_kept(kind, code, text)
            if kind == "think-budget" and code == 200:
                used = (json.loads(text)["usage"].get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
                if used > body["thinking_token_budget"] + 1:  # type: ignore[operator]
                    code, text = (
                        599,
                        f"thinking_token_budget {body['thinking_token_budget']} not kept: {used} " + text[:300],
                    )
            return kind, code, text

        t0 = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as ex:
            got = list(ex.map(one, range(args.requests)))
        took = time.monotonic() - t0
        time.sleep(5)  # the last heartbeats carry the nodes' free memory to the router
        metrics = urllib.request.urlopen(base.removesuffix("/v1") + "/metrics").read().decode()
    finally:
        up.terminate()
        try:
            up.wait(120)
        except subprocess.TimeoutExpired:
            up.kill()
    log_text = log_path.read_text()
    print(f"{args.requests} requests at {args.concurrency} at once in {took:.0f} s")
    for (kind, code), n in sorted(Counter((k, c) for k, c, _ in got).items()):
        print(f"  {kind:15s} {code:4d} x{n}")
    # one line per kind of answer (ids and figures as #), the first of its kind in full
    errors: Counter[str] = Counter()
    first: dict[str, str] = {}
    for _, c, t in got:
        if c >= 400:
            key = re.sub(r"\b[0-9a-f]{32}\b(-\d+)?|\d+(\.\d+)?", "#", t)[:160]
            errors[key] += 1
            first.setdefault(key, t[:160])
    for key, n in errors.most_common(8):
        print(f"  x{n}: {first[key]}")
    exits = re.findall(r"^pdserve up: .* exited with status .*$", log_text, re.M)
    warns = Counter(
        re.sub(r"\b[0-9a-f]{32}\b(-\d+)?|\d+(\.\d+)?", "#", ln.split(" ", 3)[-1])[:200]
        for ln in log_text.splitlines()
        if " WARNING " in ln or " ERROR " in ln
    )
    for text, n in warns.most_common(12):
        print(f"  log x{n}: {text}")
    used = [_metric(metrics, f"pdserve_router_{m}_used") for m in ("kv_pages", "state_slots")]
    print(f"  node exits: {exits or 'none'}; pages, slots in use after: {used}")
    bad = exits or any(c >= 500 for _, c, _ in got) or any(u != 0 for u in used)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
