"""The `pdserve` command line: `up`, `router`, `decode`, `prefill`, `encode`, `nodes`, `generate`, `demo`,
`make-tiny-model`. Component flags are generated from their configs; errors print one line and
exit 2 (README.md, "CLI")."""

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

from router import vllm_flags
from router.child_env import apply_launch_env
from router.console import say
from router.version import pdserve_version

DEFAULT_HOME = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
DEMO_PROMPTS = [
    "Hello world! How are you today?",
    "The router picks a decode node and",
    "Hybrid language models mix linear attention layers with",
    "Once upon a time there was a small model",
]


SERVER_COMMANDS = ("up", "router", "decode", "prefill", "encode")
DRAIN_HELP = (
    "on SIGTERM / SIGINT, finish what is in flight for at most this many seconds, taking nothing new, "
    "then stop (0: stop at once; a second signal cuts the wait short)"
)


def default_model_dir() -> Path:
    """The embedded default: a tiny random Qwen3.5 checkpoint, made on first use."""
    d = DEFAULT_HOME / "tiny-qwen3.5"
    if not (d / "config.json").is_file():
        from engine.tiny_model import make_tiny_model

        say(f"making the built-in tiny model in {d} ...")
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
    vl = f", vision tower depth {spec.vision_depth} + image processor" if spec.vision else ""
    print(
        f"wrote {out} ({spec.arch}, {spec.layers} layers, hidden {spec.hidden}{moe}{fp8}{vl}, vocab {spec.vocab}, "
        f"seed {spec.seed})"
    )
    return 0


def cmd_demo(args) -> int:
    """`up` with the built-in tiny model (one prefill + one decode node), a few prompts streamed
    through the SDK with per-request TTFT / TPOT / transfer figures."""
    from client import Client, GenerateResult
    from engine.config import ModelConfig
    from router.launch import Cluster, PoolSpec

    model = Path(args.model) if args.model else default_model_dir()
    ModelConfig.from_dir(model)  # a bad directory fails here, in one line
    spec = PoolSpec(
        model=str(model),
        prefill=1,
        decode=1,
        prefill_tp=args.tp,
        decode_tp=args.tp,
        port=0,
        node_options={"dtype": "float32"},
        log_level=args.log_level or "WARNING",
    )
    say(f"starting a router, 1 prefill and 1 decode node (tp={args.tp}) on {model} ...")
    with Cluster(spec) as cl:
        cl.start()
        say(f"ready at {cl.address}")
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
def _serve_until_signal(server, drain_timeout: float, ready: str) -> int:
    """Say `ready` once SIGINT / SIGTERM are ours (a signal right after it drains, never kills),
    block until one comes; then drain (take nothing new, let what is in flight finish, at most
    drain_timeout seconds; a second signal cuts it short) and stop cleanly."""
    from serving.rpc import Interrupt

    stop, now = threading.Event(), Interrupt()  # `now` wakes the drain's wait at once

    def on_signal(*_):
        (now if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    say(ready)
    while not stop.wait(0.5):
        if fatal := getattr(server, "fatal", None):  # a node that can serve no more: stop, non-zero
            logging.getLogger("pdserve.node").error("%s; stopping with status 1 so it is restarted", fatal)
            server.stop(grace=1.0)
            return 1
    if drain_timeout > 0:
        server.drain(drain_timeout, interrupt=now)
    server.stop()
    return 0


def cmd_router(args) -> int:
    from engine.options import options, values
    from router.server import RouterConfig, run
    from serving.security import credentials, require_token

    cfg = RouterConfig(**values(options(RouterConfig), args))
    creds = credentials(cfg, api_keys=True)
    require_token(creds, cfg.insecure_open_cluster, "pdserve router")
    return run(cfg, args.port, args.port_file, args.drain_timeout, creds)


def _node_config(cls, args):
    """A node's config from its command line: every option of `cls`."""
    from engine.options import options, values

    vals = values(options(cls), args)
    vals["model"] = str(vals["model"] or default_model_dir())
    vals["advertise_host"] = vals["advertise_host"] or args.host
    # the data plane binds where the node binds (bound to a wildcard: where it is dialed, advertise_host,
    # which the config falls back on)
    if not vals["transfer_host"] and args.host not in ("0.0.0.0", "::") and args.host != vals["advertise_host"]:
        vals["transfer_host"] = args.host
    return cls(**vals)


def _serve_node(kind: str, cfg, args) -> int:
    """The node's checks first, then its server module (torch with it: seconds), then the node."""
    import importlib

    from engine import heap
    from serving.security import credentials, require_token

    require_token(credentials(cfg), cfg.insecure_open_cluster, f"pdserve {kind}")
    serve = importlib.import_module(f"{kind}_node.server").serve
    _log_host_share(kind, cfg)
    node, _ = serve(f"{args.host}:{args.port}", cfg)
    heap.settle()  # the model and the server are up: what they hold is out of the collector's walk
    return _serve_until_signal(node, args.drain_timeout, f"{kind} node {cfg.node_id} listening on {node.address}")


def _log_host_share(kind: str, cfg) -> None:
    """What the node runs on: torch threads, CPUs, nice value, and a decode node's step hold."""
    import torch

    held = getattr(cfg, "yield_to_prefill_ms", 0.0)
    logging.getLogger("pdserve.node").info(
        "%s node %s: %d torch threads on CPUs %s, nice %d%s",
        kind,
        cfg.node_id,
        torch.get_num_threads(),
        ",".join(map(str, sorted(os.sched_getaffinity(0)))),
        os.nice(0),
        f", decode steps held up to {held:g} ms for prompts" if held else "",
    )


def cmd_decode(args) -> int:
    from decode_node.config import DecodeNodeConfig

    return _serve_node("decode", _node_config(DecodeNodeConfig, args), args)


def cmd_prefill(args) -> int:
    from prefill_node.config import PrefillNodeConfig

    return _serve_node("prefill", _node_config(PrefillNodeConfig, args), args)


def cmd_encode(args) -> int:
    from encode_node.config import EncodeNodeConfig

    return _serve_node("encode", _node_config(EncodeNodeConfig, args), args)


def _up_spec(args):
    from router.pools import spec_from_args

    return spec_from_args(args, default_model=default_model_dir)


def _exit_cause(rc: int) -> str:
    """What a node's exit status says beyond itself: the signal that ended it, and what to do."""
    if rc >= 0:
        return "" if rc == 0 else "; the router routes around it (its log above says why)"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    crash = ", a crash in native code: report it with its log above" if -rc in (4, 6, 7, 8, 11) else ""
    return f" ({name}{crash}); the router routes around it"


def cmd_up(args) -> int:
    from router.launch import Cluster

    spec = _up_spec(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cl = Cluster(spec, should_stop=stop.is_set)
    try:
        say(
            f"pdserve up: router + {spec.prefill} prefill (tp={spec.prefill_tp}) + {spec.decode} decode "
            f"(tp={spec.decode_tp}){f' + {spec.encode} encode' if spec.encode else ''} node(s) on {spec.model}"
        )
        try:
            cl.start()
        except KeyboardInterrupt:
            say("pdserve up: interrupted during start-up; stopping")
            return 130
        say(f"pdserve up: ready at {cl.address}")
        if cl.token_file is not None:  # a token made for this cluster: where `pdserve nodes` finds it
            say(f"pdserve up: cluster token in {cl.token_file} (pdserve nodes --cluster-token-file {cl.token_file})")
        while not stop.wait(0.2):
            for name, rc in cl.poll_exited():
                if name == "router":
                    raise RuntimeError(f"the router exited with status {rc}; stopping everything")
                # the router notices through missing heartbeats and routes around the node
                say(f"pdserve up: {name} exited with status {rc}{_exit_cause(rc)}")
        say("pdserve up: stopping")
        return 0
    finally:
        cl.stop()


def cmd_generate(args) -> int:
    from client import Client, GenerateResult, PdserveError

    kw = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    if args.chat and (args.token_ids or args.prompt is None):
        raise ValueError("--chat takes a text prompt (no --token-ids)")
    if args.token_ids:
        kw["prompt_token_ids"] = [int(t) for t in args.token_ids.replace(",", " ").split()]
    elif args.prompt is None:
        raise ValueError("give a prompt (text) or --token-ids")
    else:
        kw["prompt"] = args.prompt
    # each image a file or a URL; the prompt holds one placeholder per image (docs/images.md)
    if args.image and not args.chat:
        from client import IMAGE_PLACEHOLDER

        if IMAGE_PLACEHOLDER not in (args.prompt or ""):
            kw["prompt"] = IMAGE_PLACEHOLDER * len(args.image) + (args.prompt or "")
        kw["images"] = [x if "://" in x or x.startswith("data:") else Path(x) for x in args.image]
    tls = dict(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_server_name=args.tls_server_name)
    with Client(args.addr, api_key=args.api_key, **tls) as c:
        try:
            c.wait_ready(timeout=args.wait)
            if args.chat:
                from router.cli_chat import run_chat

                return run_chat(c, args, kw) or 0
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
    from serving.rpc import channel
    from serving.security import credentials

    with channel(args.addr, credentials(args)) as ch:
        try:
            nodes = rpc.RegistryStub(ch).ListNodes(pb.ListNodesRequest(), timeout=args.wait).nodes
        except grpc.RpcError as e:
            hint = ""
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                hint = (
                    "; give the cluster's token with --cluster-token-file FILE or PDSERVE_CLUSTER_TOKEN "
                    "(pdserve up prints where the one it made is)"
                )
            raise ValueError(f"router {args.addr}: {e.code().name}: {e.details()}{hint}") from None
    head = ("node", "kind", "address", "state", "tp", "pages free", "slots free")
    head += ("running", "waiting", "queued tokens", "seen")
    rows = []
    for n in sorted(nodes, key=lambda n: (n.node.kind, n.node.node_id)):
        i, c = n.node, n.node.capacity
        state = "dead" if not n.alive else "draining" if i.draining else "up"
        kind = pb.NodeKind.Name(i.kind).removeprefix("NODE_KIND_").lower()
        room = (f"{c.free_blocks}/{c.total_blocks}", f"{c.free_slots}/{c.total_slots}")
        load = (str(c.running), str(c.waiting), str(c.queued_prefill_tokens))
        rows.append((i.node_id, kind, i.address, state, str(i.tp_size), *room, *load, f"{n.last_seen_s:.1f}s ago"))
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    if not rows:
        print(f"(no node has registered with {args.addr})")
    return 0


def _add_client_security(p: argparse.ArgumentParser, node_plane: bool) -> None:
    """A client's credentials: the API key (generate) or the cluster token (nodes), and TLS."""
    if node_plane:
        p.add_argument(
            "--cluster-token-file", default=None, help="file holding the cluster token (default: PDSERVE_CLUSTER_TOKEN)"
        )
    else:
        p.add_argument("--api-key", default=None, help="the router's client API key (default: PDSERVE_API_KEY)")
    p.add_argument("--tls-ca", default=None, help="PEM CA bundle the router's certificate is checked against (TLS)")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate to show (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-server-name", default=None, help="the name the router's certificate is checked against")


def build_parser() -> argparse.ArgumentParser:
    from decode_node.config import DecodeNodeConfig
    from encode_node.config import EncodeNodeConfig
    from engine.options import add_options, options
    from prefill_node.config import PrefillNodeConfig
    from router.config import RouterConfig
    from router.pools import add_up_options

    ap = argparse.ArgumentParser(prog="pdserve", description="Disaggregated serving for hybrid LLMs")
    ap.add_argument("--version", action="version", version=f"pdserve {pdserve_version()}")
    ap.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG"), help="default INFO for servers, else WARNING")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser(
        "make-tiny-model", help="write a small random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint + tokenizer"
    )
    p.add_argument("dir")
    _add_tiny_args(p)
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("demo", help="serve the built-in tiny model and stream a few prompts through it")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("up", help="run a router and node pools as local processes")
    add_up_options(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("router", help="run the router")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--port-file", default=None, help="write the bound port here (for --port 0)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help=DRAIN_HELP)
    add_options(p, options(RouterConfig))
    p.set_defaults(func=cmd_router)

    commands = {"decode": cmd_decode, "prefill": cmd_prefill, "encode": cmd_encode}
    for kind, cls in (("decode", DecodeNodeConfig), ("prefill", PrefillNodeConfig), ("encode", EncodeNodeConfig)):
        p = sub.add_parser(
            kind, help=f"run one {kind} node" + (" (the vision encoder only)" if kind == "encode" else "")
        )
        p.add_argument("--host", default="127.0.0.1", help="address the node binds")
        p.add_argument("--port", type=int, default=0, help="gRPC port (0 picks one)")
        p.add_argument("--drain-timeout", type=float, default=30.0, help=DRAIN_HELP)
        add_options(p, options(cls), defaults={"advertise_host": None})
        p.set_defaults(func=commands[kind])

    p = sub.add_parser("nodes", help="list the nodes a router knows: state, capacity, load")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--wait", type=float, default=10.0, help="seconds to wait for the router")
    _add_client_security(p, node_plane=True)
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
    p.add_argument(
        "--image",
        action="append",
        default=[],
        help="an image file or URL (repeatable); placed before the prompt unless the prompt holds "
        "<|vision_start|><|image_pad|><|vision_end|> once per image (with --chat: image parts before the text)",
    )
    p.add_argument("--chat", action="store_true", help="the prompt as a user message, in the model's chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message first")
    p.add_argument("--no-thinking", action="store_true", help="with --chat: the template's enable_thinking off")
    p.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the router to be ready")
    _add_client_security(p, node_plane=False)
    p.set_defaults(func=cmd_generate)
    return ap


def main(argv: list[str] | None = None) -> int:
    apply_launch_env()  # before any thread starts: what the process that started this one asked
    try:
        parser = build_parser()
    except ImportError as e:  # an environment the engine cannot load in (engine/__init__.py says why)
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    try:
        argv = vllm_flags.rewrite(sys.argv[1:] if argv is None else list(argv))
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    level = args.log_level or ("INFO" if args.cmd in SERVER_COMMANDS else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if isinstance(getattr(args, "model", None), str):  # a Hugging Face repo id: its cached snapshot
            from engine.hub import resolve  # noqa: PLC0415 (the engine package may refuse to import: its error)

            args.model = resolve(args.model)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError, RuntimeError, TimeoutError) as e:
        print(f"pdserve {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
