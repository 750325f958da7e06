"""The `pdserve` command line.

    pdserve make-tiny-model DIR [--arch qwen3_5|qwen3_5_moe|qwen3_next --layers 8 --hidden 256 ... --seed 0]
    pdserve demo [--model DIR] [--tp 1] [--max-tokens 32]     # `up`, a few prompts via the SDK, shutdown
    pdserve up --model DIR --prefill N --decode M --prefill-tp a --decode-tp b --port P  (or --config pools.yaml)
    pdserve router --port P [--model DIR] [--decode ADDR ...] [--prefill ADDR ...]
    pdserve decode --model DIR --router HOST:PORT [--port 0] [--tp b] [--local-prefill-threshold T]
    pdserve prefill --model DIR --router HOST:PORT [--port 0] [--tp a] [--transfer-backend nixl]
    pdserve generate --addr HOST:PORT "text" [--max-tokens 32 --temperature 0]

A pools file for `up --config` takes the `up` options as keys; the command line wins:

    model: /path/to/checkpoint
    port: 50051
    prefill: {count: 1, tp: 2}
    decode: {count: 2, tp: 1, local_prefill_threshold: 64, kv_cache_memory: 2GiB}
    policy: least-loaded

Errors print one line and exit with status 2; no stack traces.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import typing
from dataclasses import fields
from pathlib import Path

DEFAULT_HOME = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
DEMO_PROMPTS = [
    "Hello world! How are you today?",
    "The router picks a decode node and",
    "Hybrid language models mix linear attention layers with",
    "Once upon a time there was a small model",
]


SERVER_COMMANDS = ("up", "router", "decode", "prefill")
SPECULATIVE_METHODS = ("ngram", "mtp")  # engine.config.SPECULATIVE_METHODS, without importing torch here
SPEC_HELP = ("draft tokens verified per decode step (0: off); prefill and decode nodes must use the same "
             "value")
SPEC_METHOD_HELP = ("where drafts come from: ngram (prompt lookup) or mtp (the checkpoint's multi-token-prediction "
                    "block); prefill and decode nodes must use the same method")
QUEUE_HELP = ("when every prefill node has this many prompt tokens queued, decode nodes prefill new prompts "
              "themselves (0: no limit)")
ADMISSION_HELP = "seconds a request waits in the router's FIFO admission queue, then RESOURCE_EXHAUSTED"
QUEUE_LIMIT_HELP = "requests that may wait for admission; one more is refused RESOURCE_EXHAUSTED at once (0: no limit)"
WINDOW_HELP = ("prompt tokens the router keeps outstanding per prefill node (sent, first token not back); the rest "
               "wait in the admission queue without reserving decode memory (0: no window)")
LEASE_HELP = ("seconds a decode reservation lives without a renewal; prefill nodes renew it while they work on the "
              "request, so it runs out only for a dead or hung prefill node")
DRAIN_HELP = ("on SIGTERM / SIGINT, finish what is in flight for at most this many seconds, taking nothing new, "
              "then stop (0: stop at once; a second signal cuts the wait short)")


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

    hints = typing.get_type_hints(TinyModelSpec)
    for f in fields(TinyModelSpec):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif typing.get_origin(hints[f.name]) is typing.Literal:
            p.add_argument(flag, choices=typing.get_args(hints[f.name]), default=f.default)
        else:
            typ = {"int": int, "float": float, "str": str}.get(str(f.type), type(f.default))
            p.add_argument(flag, type=typ, default=f.default)


def cmd_make_tiny_model(args) -> int:
    from engine.tiny_model import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(**{f.name: getattr(args, f.name) for f in fields(TinyModelSpec)})
    out = make_tiny_model(args.dir, spec)
    moe = f", {spec.experts} experts top-{spec.top_k}" if spec.arch != "qwen3_5" else ""
    fp8 = f", fp8 blocks {spec.fp8_block}" if spec.fp8 else ""
    print(f"wrote {out} ({spec.arch}, {spec.layers} layers, hidden {spec.hidden}{moe}{fp8}, vocab {spec.vocab}, "
          f"seed {spec.seed})")
    return 0


def cmd_demo(args) -> int:
    """`up` with the built-in tiny model (one prefill + one decode node), a few prompts streamed
    through the SDK with per-request TTFT / TPOT / transfer figures."""
    from client import Client, GenerateResult
    from engine.config import ModelConfig
    from router.launch import Cluster, PoolSpec

    model = Path(args.model) if args.model else default_model_dir()
    ModelConfig.from_dir(model)  # a bad directory fails here, in one line
    spec = PoolSpec(model=str(model), prefill=1, decode=1, prefill_tp=args.tp, decode_tp=args.tp, port=0,
                    dtype="float32", log_level=args.log_level or "WARNING")  # fmt: skip
    print(f"starting a router, 1 prefill and 1 decode node (tp={args.tp}) on {model} ...", flush=True)
    with Cluster(spec) as cl:
        cl.start()
        print(f"ready at {cl.address}", flush=True)
        with Client(cl.address) as c:
            c.wait_ready(timeout=60)
            t0 = time.perf_counter()
            n = 0
            for prompt in DEMO_PROMPTS:
                print(f"\n> {prompt}\n  ", end="", flush=True)
                res = GenerateResult()
                with c.stream(prompt=prompt, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True) as s:
                    for chunk in s:
                        res.add(chunk)
                        print(chunk.text, end="", flush=True)
                n += len(res.token_ids)
                print(
                    f"\n  tokens {res.token_ids[:12]}... ({res.finish_reason}) on {res.decode_node}, "
                    f"prefill {res.prefill_node or 'local'}: "
                    f"TTFT {res.ttft_s * 1e3:.1f} ms, TPOT {res.tpot_s * 1e3:.1f} ms, "
                    f"transfer {res.transfer_bytes} B in {res.transfer_s * 1e3:.1f} ms"
                )
            dt = time.perf_counter() - t0
        print(f"\n{len(DEMO_PROMPTS)} requests, {n} new tokens in {dt:.2f} s: {n / dt:.1f} tokens/s; shutting down")
    return 0


# ---- serving components ---------------------------------------------------------------------
def _serve_until_signal(server, drain_timeout: float) -> int:
    """Block until SIGINT / SIGTERM; then drain (take nothing new, let what is in flight finish,
    at most drain_timeout seconds; a second signal cuts it short) and stop cleanly."""
    stop, now = threading.Event(), threading.Event()

    def on_signal(*_):
        (now if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    while not stop.wait(0.5):
        pass
    if drain_timeout > 0:
        server.drain(drain_timeout, interrupt=now)
    server.stop()
    return 0


def cmd_router(args) -> int:
    from router.server import RouterConfig, serve

    cfg = RouterConfig(
        model=args.model,
        static_decode=tuple(args.decode or ()),
        static_prefill=tuple(args.prefill or ()),
        heartbeat_interval_s=args.heartbeat_interval,
        dead_after_s=args.dead_after,
        admission_timeout_s=args.admission_timeout,
        max_queued_requests=args.max_queued_requests,
        prefill_window_tokens=args.prefill_window_tokens,
        reservation_lease_s=args.reservation_lease,
        max_prefill_queue_tokens=args.max_prefill_queue_tokens,
        policy=args.policy,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        host=args.host,
    )
    router, port = serve(f"{args.host}:{args.port}", cfg)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.rename(args.port_file)
    print(f"router listening on {args.host}:{port}", flush=True)
    if router.http_port is not None:
        print(f"router OpenAI-compatible HTTP on http://{args.host}:{router.http_port}/v1", flush=True)
    return _serve_until_signal(router, args.drain_timeout)


def _node_config(cls, args, **extra):
    """A node's config from its command line: the engine settings plus how it joins the router."""
    return cls(
        model=str(args.model or default_model_dir()),
        tensor_parallel_size=args.tp,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        device=args.device,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_method=args.speculative_method,
        node_id=args.node_id,
        router=args.router,
        advertise_host=args.advertise_host or args.host,
        transfer_backend=args.transfer_backend,
        metrics_port=args.metrics_port,
        **extra,
    )


def _serve_node(kind: str, serve, cfg, args) -> int:
    node, _ = serve(f"{args.host}:{args.port}", cfg)
    print(f"{kind} node {cfg.node_id} listening on {node.address}", flush=True)
    return _serve_until_signal(node, args.drain_timeout)


def cmd_decode(args) -> int:
    from decode_node.config import DecodeNodeConfig
    from decode_node.server import serve

    cfg = _node_config(DecodeNodeConfig, args, local_prefill_threshold=args.local_prefill_threshold)
    return _serve_node("decode", serve, cfg, args)


def cmd_prefill(args) -> int:
    from prefill_node.server import PrefillNodeConfig, serve

    return _serve_node("prefill", serve, _node_config(PrefillNodeConfig, args), args)


_UP_DEFAULTS = dict(model=None, prefill=1, decode=1, prefill_tp=1, decode_tp=1, host="127.0.0.1", port=50051,
                    dtype="auto", device="cpu", kv_cache_memory="256MiB", max_num_seqs=64,
                    max_num_batched_tokens=2048, local_prefill_threshold=0,
                    policy="least-loaded", admission_timeout=30.0, max_queued_requests=512,
                    prefill_window_tokens=8192, reservation_lease=15.0, max_prefill_queue_tokens=0,
                    transfer_backend="nixl", num_speculative_tokens=0, speculative_method="ngram",
                    http_port=None, metrics_port=None, drain_timeout=30.0)  # fmt: skip


def _up_spec(args):
    from router.launch import PoolSpec

    vals = {k: getattr(args, k) for k in _UP_DEFAULTS}
    if args.config:
        import yaml

        raw = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{args.config}: expected a mapping of options")
        flat = {}
        for k, v in raw.items():
            if k in ("prefill", "decode") and isinstance(v, dict):  # prefill: {count: 1, tp: 2}
                flat[k] = v.get("count", _UP_DEFAULTS[k])
                flat[f"{k}_tp"] = v.get("tp", 1)
                for kk, vv in v.items():
                    if kk not in ("count", "tp"):
                        flat[kk.replace("-", "_")] = vv
            else:
                flat[k.replace("-", "_")] = v
        unknown = sorted(set(flat) - set(_UP_DEFAULTS))
        if unknown:
            raise ValueError(f"{args.config}: unknown option(s) {', '.join(unknown)}; known: {', '.join(_UP_DEFAULTS)}")
        for k, v in flat.items():
            if vals[k] is None:  # the command line wins
                vals[k] = v
    vals = {k: (_UP_DEFAULTS[k] if v is None else v) for k, v in vals.items()}
    if vals["model"] is None:
        vals["model"] = str(default_model_dir())
    from engine.config import ModelConfig

    ModelConfig.from_dir(vals["model"])
    return PoolSpec(
        model=str(Path(vals["model"]).resolve()), prefill=vals["prefill"], decode=vals["decode"],
        prefill_tp=vals["prefill_tp"], decode_tp=vals["decode_tp"], host=vals["host"], port=vals["port"],
        dtype=vals["dtype"], device=vals["device"], kv_cache_memory=str(vals["kv_cache_memory"]),
        max_num_seqs=vals["max_num_seqs"], max_num_batched_tokens=int(vals["max_num_batched_tokens"]),
        local_prefill_threshold=vals["local_prefill_threshold"], policy=vals["policy"],
        admission_timeout_s=float(vals["admission_timeout"]), log_level=args.log_level or "INFO",
        max_queued_requests=int(vals["max_queued_requests"]),
        prefill_window_tokens=int(vals["prefill_window_tokens"]),
        reservation_lease_s=float(vals["reservation_lease"]),
        max_prefill_queue_tokens=int(vals["max_prefill_queue_tokens"]),
        num_speculative_tokens=int(vals["num_speculative_tokens"]),
        speculative_method=str(vals["speculative_method"]),
        transfer_backend=vals["transfer_backend"], http_port=vals["http_port"],
        metrics_port=vals["metrics_port"], drain_timeout_s=float(vals["drain_timeout"]),
    )  # fmt: skip


def cmd_up(args) -> int:
    from router.launch import Cluster

    spec = _up_spec(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cl = Cluster(spec, should_stop=stop.is_set)
    try:
        print(
            f"pdserve up: router + {spec.prefill} prefill (tp={spec.prefill_tp}) + {spec.decode} decode "
            f"(tp={spec.decode_tp}) node(s) on {spec.model}",
            flush=True,
        )
        try:
            cl.start()
        except KeyboardInterrupt:
            print("pdserve up: interrupted during start-up; stopping", flush=True)
            return 130
        print(f"pdserve up: ready at {cl.address}", flush=True)
        while not stop.wait(0.2):
            for name, rc in cl.poll_exited():
                if name == "router":
                    raise RuntimeError(f"the router exited with status {rc}; stopping everything")
                # the router notices through missing heartbeats and routes around the node
                print(f"pdserve up: {name} exited with status {rc}", flush=True)
        print("pdserve up: stopping", flush=True)
        return 0
    finally:
        cl.stop()


def cmd_generate(args) -> int:
    from client import Client, GenerateResult, PdserveError

    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              seed=args.seed, ignore_eos=args.ignore_eos)  # fmt: skip
    if args.token_ids:
        kw["prompt_token_ids"] = [int(t) for t in args.token_ids.replace(",", " ").split()]
    elif args.prompt is None:
        raise ValueError("give a prompt (text) or --token-ids")
    else:
        kw["prompt"] = args.prompt
    with Client(args.addr) as c:
        try:
            c.wait_ready(timeout=args.wait)
            res = GenerateResult()
            with c.stream(**kw) as s:
                for chunk in s:
                    res.add(chunk)
                    print(
                        chunk.text if chunk.text or not chunk.token_ids else f" {chunk.token_ids}", end="", flush=True
                    )
        except PdserveError as e:
            raise ValueError(f"{e.code.name}: {e.message}") from None
        except TimeoutError as e:
            raise ValueError(str(e)) from None
    print(
        f"\n[{len(res.token_ids)} tokens, {res.finish_reason}; TTFT {res.ttft_s * 1e3:.1f} ms, "
        f"TPOT {res.tpot_s * 1e3:.1f} ms]",
        file=sys.stderr,
    )
    return 0


def cmd_nodes(args) -> int:
    """The nodes a router knows, one line each (what an operator checks first)."""
    import grpc

    from proto import pb, rpc
    from proto.serving import channel

    with channel(args.addr) as ch:
        try:
            nodes = rpc.RegistryStub(ch).ListNodes(pb.ListNodesRequest(), timeout=args.wait).nodes
        except grpc.RpcError as e:
            raise ValueError(f"router {args.addr}: {e.code().name}: {e.details()}") from None
    head = ("node", "kind", "address", "state", "tp", "pages free", "slots free", "running", "waiting",
            "queued tokens", "seen")  # fmt: skip
    rows = []
    for n in sorted(nodes, key=lambda n: (n.node.kind, n.node.node_id)):
        i, c = n.node, n.node.capacity
        state = "dead" if not n.alive else "draining" if i.draining else "up"
        rows.append((i.node_id, pb.NodeKind.Name(i.kind).removeprefix("NODE_KIND_").lower(), i.address, state,
                     str(i.tp_size), f"{c.free_blocks}/{c.total_blocks}", f"{c.free_slots}/{c.total_slots}",
                     str(c.running), str(c.waiting), str(c.queued_prefill_tokens),
                     f"{n.last_seen_s:.1f}s ago"))  # fmt: skip
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    if not rows:
        print(f"(no node has registered with {args.addr})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdserve", description="Disaggregated serving for hybrid LLMs")
    ap.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG"), help="default INFO for servers, else WARNING")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("make-tiny-model", help="write a small random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint + tokenizer")
    p.add_argument("dir")
    _add_tiny_args(p)
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("demo", help="serve the built-in tiny model and stream a few prompts through it")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("up", help="run a router and node pools as local processes")
    p.add_argument("--config", default=None, help="pools.yaml: the options below as keys (the command line wins)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--prefill", type=int, default=None, help="prefill nodes (default 1; 0: decode nodes prefill)")
    p.add_argument("--decode", type=int, default=None, help="decode nodes (default 1)")
    p.add_argument("--prefill-tp", type=int, default=None)
    p.add_argument("--decode-tp", type=int, default=None)
    p.add_argument("--host", default=None, help="address every component binds (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="router port (default 50051; 0 picks one)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None, help="cpu | cuda (decode nodes)")
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="every node's token budget per engine step (default 2048); a prefill step is at most this "
                        "long, and a reservation lease must outlast one")  # fmt: skip
    p.add_argument("--local-prefill-threshold", type=int, default=None)
    p.add_argument("--policy", default=None)
    p.add_argument("--admission-timeout", type=float, default=None, help=ADMISSION_HELP + " (default 30)")
    p.add_argument("--max-queued-requests", type=int, default=None, help=QUEUE_LIMIT_HELP + " (default 512)")
    p.add_argument("--prefill-window-tokens", type=int, default=None, help=WINDOW_HELP + " (default 8192)")
    p.add_argument("--reservation-lease", type=float, default=None, help=LEASE_HELP + " (default 15)")
    p.add_argument("--max-prefill-queue-tokens", type=int, default=None, help=QUEUE_HELP)
    p.add_argument("--num-speculative-tokens", type=int, default=None, help=SPEC_HELP + " (every node; default 0)")
    p.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                   help=SPEC_METHOD_HELP + " (every node; default ngram)")
    p.add_argument("--transfer-backend", default=None, help="nixl | ucxx (default nixl)")
    p.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP on the router (0 picks one)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus /metrics on the router (0 picks one); every node then serves one on a free port")
    p.add_argument("--drain-timeout", type=float, default=None, help=DRAIN_HELP + " (every component; default 30)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("router", help="run the router")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--port-file", default=None, help="write the bound port here (for --port 0)")
    p.add_argument("--model", default=None, help="checkpoint whose tokenizer serves text prompts")
    p.add_argument("--decode", action="append", metavar="ADDR", help="a static decode node (repeatable)")
    p.add_argument("--prefill", action="append", metavar="ADDR", help="a static prefill node (repeatable)")
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--dead-after", type=float, default=3.0)
    p.add_argument("--admission-timeout", type=float, default=30.0, help=ADMISSION_HELP)
    p.add_argument("--max-queued-requests", type=int, default=512, help=QUEUE_LIMIT_HELP)
    p.add_argument("--prefill-window-tokens", type=int, default=8192, help=WINDOW_HELP)
    p.add_argument("--reservation-lease", type=float, default=15.0, help=LEASE_HELP)
    p.add_argument("--max-prefill-queue-tokens", type=int, default=0, help=QUEUE_HELP)
    p.add_argument("--policy", default="least-loaded")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0 picks one; default off)")
    p.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP port (0 picks one; default off)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help=DRAIN_HELP)
    p.set_defaults(func=cmd_router)

    for kind in ("decode", "prefill"):
        p = sub.add_parser(kind, help=f"run one {kind} node")
        p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
        p.add_argument("--router", default=None,
                       help="router HOST:PORT to register with; several, comma-separated, for more than one "
                            "router (each can then route here)")  # fmt: skip
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=0)
        p.add_argument("--advertise-host", default=None, help="host the router dials (default --host)")
        p.add_argument("--node-id", default=f"{kind}-0")
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--dtype", default="auto")
        p.add_argument("--device", default="cpu", help="cpu | cuda")
        p.add_argument("--kv-cache-memory", default="256MiB")
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048)
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--transfer-backend", default="nixl", help="nixl | ucxx")
        p.add_argument("--metrics-port", type=int, default=None,
                       help="Prometheus /metrics port (0 picks one; default off)")  # fmt: skip
        p.add_argument("--drain-timeout", type=float, default=30.0, help=DRAIN_HELP)
        p.add_argument("--num-speculative-tokens", type=int, default=0, help=SPEC_HELP)
        p.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default="ngram", help=SPEC_METHOD_HELP)
        if kind == "decode":
            p.add_argument("--local-prefill-threshold", type=int, default=0,
                           help="prompts shorter than this prefill here (0: always the prefill pool, "
                                "when a prefill node is ready)")  # fmt: skip
        p.set_defaults(func=cmd_decode if kind == "decode" else cmd_prefill)

    p = sub.add_parser("nodes", help="list the nodes a router knows: state, capacity, load")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--wait", type=float, default=10.0, help="seconds to wait for the router")
    p.set_defaults(func=cmd_nodes)

    p = sub.add_parser("generate", help="stream a completion from a router")
    p.add_argument("prompt", nargs="?", default=None)
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--token-ids", default=None, help="send token ids instead of text: '1,2,3'")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the router to be ready")
    p.set_defaults(func=cmd_generate)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = args.log_level or ("INFO" if args.cmd in SERVER_COMMANDS else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError, RuntimeError, TimeoutError) as e:
        print(f"pdserve {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
