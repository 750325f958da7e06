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
from pathlib import Path

from router import vllm_flags
from router.child_env import apply_launch_env
from router.cli_client import add_client_commands
from router.cli_tiny import add_tiny_args, cmd_make_tiny_model
from router.console import say
from router.version import pdserve_version

DEFAULT_HOME = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
DEMO_PROMPTS = [
    "Hello world! How are you today?",
    "The router picks a decode node and",
    "Hybrid language models mix linear attention layers with",
    "Once upon a time there was a small model",
]


SERVER_COMMANDS = ("up", "serve", "router", "decode", "prefill", "encode")
DRAIN_HELP = (
    "on SIGTERM / SIGINT, finish what is in flight for at most this many seconds, taking nothing new, "
    "then stop (0: stop at once; a second signal cuts the wait short)"
)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (`pdserve CMD: error: ...`, exit status 2), not
    the usage text and then the error: `pdserve CMD --help` lists the options."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def log_level(text: str) -> str:
    """--log-level's type: a logging level's name, any case."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown log level {text!r}; one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def error_line(who: str, e: BaseException) -> str:
    """`who: error: message`, the message's own leading `who: ` dropped (said once, not twice)."""
    return f"{who}: error: {str(e).removeprefix(who + ': ').removeprefix('error: ')}"


def default_model_dir() -> Path:
    """The embedded default: a tiny random Qwen3.5 checkpoint, made on first use."""
    d = DEFAULT_HOME / "tiny-qwen3.5"
    if not (d / "config.json").is_file():
        from engine.tiny_model import make_tiny_model

        say(f"making the built-in tiny model in {d} ...")
        make_tiny_model(d)
    return d


def cmd_demo(args) -> int:
    """`up` with the built-in tiny model (one prefill + one decode node), a few prompts streamed
    through the SDK with per-request TTFT / TPOT / transfer figures."""
    from client import Client, GenerateResult
    from engine.config import ModelConfig
    from router.launch import NODE_CONFIGS, Cluster, PoolSpec

    model = Path(args.model) if args.model else default_model_dir()
    ModelConfig.from_dir(model)  # a bad directory fails here, in one line
    for pool in ("prefill", "decode"):  # as `up` checks its pools: before anything starts, in one line
        NODE_CONFIGS[pool](model=str(model), tensor_parallel_size=args.tp, dtype="float32").engine_config(
            check_only=True
        )
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
    from serving.hosts import advertised_host

    vals["advertise_host"] = advertised_host(args.host, vals["advertise_host"])
    # the data plane binds where the node binds (bound to a wildcard: where it is dialed, advertise_host,
    # which the config falls back on)
    if not vals["transfer_host"] and args.host not in ("0.0.0.0", "::") and args.host != vals["advertise_host"]:
        vals["transfer_host"] = args.host
    return cls(**vals)


def _serve_node(kind: str, cfg, args) -> int:
    """The node's checks first, then its server module (torch with it: seconds), then the node."""
    import importlib

    from engine import heap
    from serving.security import credentials, port_free, require_token

    require_token(credentials(cfg), cfg.insecure_open_cluster, f"pdserve {kind}")
    port_free(f"{args.host}:{args.port}")  # before the model loads: a busy port says so at once
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


_NONE_LEFT = {
    "decode": "no decode node is left: every request fails until one registers",
    "prefill": "no prefill node is left: decode nodes compute the prompts",
    "encode": "no encode node is left: prefill nodes encode the images",
}


def _exit_cause(rc: int, last: str = "") -> str:
    """What a node's exit status says beyond itself: the signal that ended it, and what follows
    (`last`: the node was its pool's last, of that kind)."""
    after = _NONE_LEFT.get(last, "the router routes around it")
    if rc >= 0:
        return "" if rc == 0 and not last else f"; {after} (its log above says why)"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    crash = ", a crash in native code: report it with its log above" if -rc in (4, 6, 7, 8, 11) else ""
    return f" ({name}{crash}); {after}"


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
        gone: dict[str, int] = {}  # nodes of each kind that exited
        while not stop.wait(0.2):
            for name, rc in cl.poll_exited():
                if name == "router":
                    raise RuntimeError(f"the router exited with status {rc}; stopping everything")
                # the router notices through missing heartbeats and routes around the node
                kind = name.rsplit("-", 1)[0]
                gone[kind] = gone.get(kind, 0) + 1
                last = kind if gone[kind] >= getattr(spec, kind, 0) else ""
                say(f"pdserve up: {name} exited with status {rc}{_exit_cause(rc, last)}")
        say("pdserve up: stopping")
        return 0
    finally:
        cl.stop()


def build_parser() -> argparse.ArgumentParser:
    from decode_node.config import DecodeNodeConfig
    from encode_node.config import EncodeNodeConfig
    from engine.options import add_options, options, port, seconds
    from prefill_node.config import PrefillNodeConfig
    from router.config import RouterConfig
    from router.pools import add_up_options

    ap = OneLineParser(prog="pdserve", description="Disaggregated serving for hybrid LLMs")
    ap.add_argument("--version", action="version", version=f"pdserve {pdserve_version()}")
    ap.add_argument(
        "--log-level",
        type=log_level,
        default=None,  # PDSERVE_LOG, checked in main(): argparse's own check would blame --log-level
        help=f"{', '.join(LOG_LEVELS)} (default: PDSERVE_LOG, else INFO for servers and WARNING for the rest)",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser(
        "make-tiny-model", help="write a small random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint + tokenizer"
    )
    p.add_argument("dir", help="directory to write the checkpoint to")
    add_tiny_args(p)
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("demo", help="serve the built-in tiny model and stream a few prompts through it")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of each node (default 1)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("up", aliases=["serve"], help="run a router and node pools as local processes")
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the checkpoint, given as `vllm serve MODEL` gives it (the same as --model)",
    )
    add_up_options(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("router", help="run the router")
    p.add_argument("--port", type=port, default=50051, help="gRPC port (0 picks one; default 50051)")
    p.add_argument("--port-file", default=None, help="write the bound port here (for --port 0)")
    p.add_argument("--drain-timeout", type=seconds, default=30.0, help=DRAIN_HELP)
    add_options(p, options(RouterConfig))
    p.set_defaults(func=cmd_router)

    commands = {"decode": cmd_decode, "prefill": cmd_prefill, "encode": cmd_encode}
    for kind, cls in (("decode", DecodeNodeConfig), ("prefill", PrefillNodeConfig), ("encode", EncodeNodeConfig)):
        p = sub.add_parser(
            kind, help=f"run one {kind} node" + (" (the vision encoder only)" if kind == "encode" else "")
        )
        p.add_argument("--host", default="127.0.0.1", help="address the node binds")
        p.add_argument("--port", type=port, default=0, help="gRPC port (0 picks one; default 0)")
        p.add_argument("--drain-timeout", type=seconds, default=30.0, help=DRAIN_HELP)
        add_options(p, options(cls), defaults={"advertise_host": None})
        p.set_defaults(func=commands[kind])

    add_client_commands(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    apply_launch_env()  # before any thread starts: what the process that started this one asked
    try:
        parser = build_parser()
    except ImportError as e:  # an environment the engine cannot load in (engine/__init__.py says why)
        print(error_line("pdserve", e), file=sys.stderr)
        return 2
    notes: list[str] = []
    try:
        argv = vllm_flags.rewrite(sys.argv[1:] if argv is None else list(argv), notes)
    except ValueError as e:
        print(error_line("pdserve", e), file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.log_level is None and os.environ.get("PDSERVE_LOG"):
        try:
            args.log_level = log_level(os.environ["PDSERVE_LOG"])
        except argparse.ArgumentTypeError as e:
            print(f"pdserve: error: PDSERVE_LOG: {e}", file=sys.stderr)
            return 2
    level = args.log_level or ("INFO" if args.cmd in SERVER_COMMANDS else "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for note in notes:  # vLLM's flags that mean nothing here, said once
        logging.getLogger("pdserve.cli").info("%s", note)
    try:
        if tag := getattr(args, "model_tag", None):  # `pdserve up MODEL`, as `vllm serve MODEL`
            if args.model not in (None, tag):
                raise ValueError(f"the model is given twice ({tag} and --model {args.model}): give one")
            args.model = tag
        if isinstance(getattr(args, "model", None), str):  # a Hugging Face repo id: its cached snapshot
            from engine.hub import resolve  # noqa: PLC0415 (the engine package may refuse to import: its error)

            args.model = resolve(args.model)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError, RuntimeError, TimeoutError) as e:
        print(error_line(f"pdserve {args.cmd}", e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
