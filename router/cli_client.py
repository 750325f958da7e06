"""The `pdserve` commands that talk to a running router as its clients: `generate` (stream a
completion; `--chat` in router/cli_chat.py) and `nodes` (the router's node table), their flags and
credentials. Errors are ValueErrors, printed by router/cli.py as one line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

DEFAULT_ADDR = "127.0.0.1:50051"


class Echo:
    """Streamed text written as it comes, each piece flushed; remembers which streams were left
    mid-line, so that an error printed after partial output starts on a line of its own."""

    def __init__(self) -> None:
        self.open: dict[int, TextIO] = {}

    def __call__(self, text: str, file: TextIO | None = None) -> None:
        out = sys.stdout if file is None else file
        if not text:
            return
        print(text, end="", file=out, flush=True)
        if text.endswith("\n"):
            self.open.pop(id(out), None)
        else:
            self.open[id(out)] = out

    def end_lines(self) -> None:
        """End every line left open (before an error message)."""
        for out in self.open.values():
            print(file=out, flush=True)
        self.open.clear()


def token_ids(text: str) -> list[int]:
    """--token-ids' type: token ids separated by commas or blanks, each a whole number >= 0."""
    parts = text.replace(",", " ").split()
    if not parts or not all(t.isdigit() for t in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of token ids (whole numbers >= 0: '1,2,3')")
    return [int(t) for t in parts]


def cmd_generate(args) -> int:
    from client import Client, GenerateResult, PdserveError

    kw = {k: getattr(args, k) for k in ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos")}
    if args.chat and (args.token_ids or args.prompt is None):
        raise ValueError("--chat takes a text prompt (no --token-ids)")
    if args.token_ids:
        kw["prompt_token_ids"] = args.token_ids
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
    echo = Echo()
    with Client(args.addr, api_key=args.api_key, **tls) as c:
        try:
            try:
                c.wait_ready(timeout=min(args.wait, 2.0))
            except TimeoutError as e:  # not at once: say so, then wait out --wait
                if args.wait <= 2.0:
                    raise
                print(f"pdserve generate: {e}; waiting up to {args.wait:g} s in all (--wait)", file=sys.stderr)
                c.wait_ready(timeout=args.wait - 2.0)
            if args.chat:
                from router.cli_chat import run_chat

                run_chat(c, args, kw, echo)
                return 0
            res = GenerateResult()
            with c.stream(**kw) as s:
                for chunk in s:
                    res.add(chunk)
                    echo(chunk.text if chunk.text or not chunk.token_ids else f" {chunk.token_ids}")
        except PdserveError as e:
            echo.end_lines()
            raise ValueError(f"{e.code.name}: {e.message}") from None
        except TimeoutError as e:
            echo.end_lines()
            raise ValueError(str(e)) from None
        except BaseException:
            echo.end_lines()
            raise
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
    head: tuple[str, ...] = ("node", "kind", "address", "state", "tp", "pages free", "slots free")
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


def add_client_commands(sub) -> None:
    from engine.options import seconds  # noqa: PLC0415 (the engine package may refuse to import: build_parser says why)

    """`nodes` and `generate` on the CLI's subparsers."""
    addr_help = f"the router's gRPC address, HOST:PORT (default {DEFAULT_ADDR})"
    p = sub.add_parser("nodes", help="list the nodes a router knows: state, capacity, load")
    p.add_argument("--addr", default=DEFAULT_ADDR, help=addr_help)
    p.add_argument("--wait", type=seconds, default=10.0, help="seconds to wait for the router (default 10)")
    _add_client_security(p, node_plane=True)
    p.set_defaults(func=cmd_nodes)

    p = sub.add_parser("generate", help="stream a completion from a router")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text")
    p.add_argument("--addr", default=DEFAULT_ADDR, help=addr_help)
    p.add_argument("--token-ids", type=token_ids, default=None, help="send token ids instead of text: '1,2,3'")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens at most (default 32)")
    p.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (default: the server's, 1.0; 0: greedy)"
    )
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: all)")
    p.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling: the smallest set of this mass (default 1.0)"
    )
    p.add_argument("--seed", type=int, default=None, help="the request's sampling seed (default: the node's --seed)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token, to --max-tokens")
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
    p.add_argument("--wait", type=seconds, default=30.0, help="seconds to wait for the router to be ready (default 30)")
    _add_client_security(p, node_plane=False)
    p.set_defaults(func=cmd_generate)
