"""`pdserve up`'s options and its pools file, resolved into a PoolSpec: every router and node option
as a flag or key; top-level keys for every component, `prefill:` / `decode:` keys per pool, the
command line wins; an unknown key is refused listing the known ones. Reading the file (vLLM's
key spellings, relative paths from its directory) is router/pools_file.py."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decode_node.config import DecodeNodeConfig
from encode_node.config import EncodeNodeConfig
from engine.options import NumberError, Opt, PortError, add_options, coerce, options, port, read_value, seconds
from prefill_node.config import PrefillNodeConfig
from router.config import RouterConfig
from router.launch import NODE_CONFIGS, NODE_MANAGED, ROUTER_MANAGED, PoolSpec
from router.pools_file import dests, load_yaml, resolve_paths
from serving.hosts import unresolved

COMPONENTS = {
    "router": RouterConfig,
    "decode": DecodeNodeConfig,
    "prefill": PrefillNodeConfig,
    "encode": EncodeNodeConfig,
}
LABELS = {"router": "the router", "decode": "decode nodes", "prefill": "prefill nodes", "encode": "encode nodes"}
POOLS = tuple(NODE_CONFIGS)
POOL_ORDER = ("decode", "prefill", "encode")  # as COMPONENTS lists them
# up's own options: dest -> (type, default, help); the file takes them at the top level
OWN: dict[str, tuple[Callable[[Any], Any], Any, str]] = {
    "model": (str, None, "checkpoint directory, for the router and every node (default: the built-in tiny model)"),
    "prefill": (int, 1, "prefill nodes (0: decode nodes prefill); in the file, a number or {count: N, tp: a, ...}"),
    "decode": (int, 1, "decode nodes; in the file, a number or {count: N, tp: b, ...}"),
    "encode": (
        int,
        0,
        "encode nodes: run only the vision encoder and push each image's output to the prefill node "
        "(0: off, prefill nodes encode); in the file, a number or {count: N, ...}",
    ),
    "prefill_tp": (int, 1, "tensor-parallel ranks of each prefill node"),
    "decode_tp": (int, 1, "tensor-parallel ranks of each decode node"),
    "host": (str, "127.0.0.1", "address every component binds"),
    "advertise_host": (
        str,
        None,
        "address the nodes give the router and their peers to dial, and `up` prints for clients "
        "(default --host; with a wildcard --host such as 0.0.0.0, this machine's primary address)",
    ),
    "port": (port, 50051, "router port (0 picks one)"),
    "cluster_token_file": (
        str,
        None,
        "file holding the cluster token, handed to every component (default: PDSERVE_CLUSTER_TOKEN, else a new "
        "random one for this cluster)",
    ),
    "insecure_open_cluster": (
        bool,
        False,
        "start every component without a cluster token: any process that reaches one can join the cluster",
    ),
    "cpu_binding": (
        str,
        "none",
        "auto: the nodes on this host split its CPUs, each node's torch threads on a share of its own "
        "(prefill nodes get the remainder); none: every node runs on every CPU",
    ),
    "decode_nice": (
        int,
        None,
        "nice value (0-19) of decode nodes: prefill nodes' compute goes first where they share CPUs, so a first "
        "token waits for no decode step (default: 7 on the CPU with --cpu-binding none and a prefill pool, else 0)",
    ),
    "node_start": (
        str,
        "fork",
        "fork: every node forked from one process that imported the node code once (about 3 s of CPU less a "
        "node); spawn: each node its own python process",
    ),
    "drain_timeout": (
        seconds,
        30.0,
        "on SIGTERM, every component finishes what is in flight for at most this many "
        "seconds, taking nothing new (0: stop at once)",
    ),
}


@dataclass
class UpOption:
    """One generated flag of `up` and the field it sets in each component that has it."""

    flag: Opt  # the declaration whose flag, type and help `up` shows
    fields: dict[str, Opt] = field(default_factory=dict)  # component -> its declaration


def up_options() -> dict[str, UpOption]:
    """dest -> UpOption for every option `up` passes on: the router's, then decode's, then prefill's."""
    table: dict[str, UpOption] = {}
    for comp, cls in COMPONENTS.items():
        managed = ROUTER_MANAGED if comp == "router" else NODE_MANAGED
        for o in options(cls):
            if o.name not in managed:
                table.setdefault(o.dest, UpOption(o)).fields[comp] = o
    return table


def add_up_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        help="pools.yaml: these options as keys, per pool under prefill: and decode: (the command line wins)",
    )
    for dest, (typ, default, text) in OWN.items():
        flag = "--" + dest.replace("_", "-")
        if typ is bool:
            p.add_argument(flag, action="store_const", const=True, default=None, help=text)
            continue
        shown = "" if default is None else f" (default {default})"
        p.add_argument(flag, type=typ, default=None, help=text + shown)
    for u in up_options().values():
        who = [LABELS[c] for c in u.fields]
        if who in ([LABELS["decode"], LABELS["prefill"]], [LABELS[c] for c in POOL_ORDER]):
            who = ["every node"]
        if u.flag.name == "metrics_port":
            who = ["the router; every node then serves one on a free port"]
        add_options(p, [u.flag], unset=True, note=f" [{'; '.join(who)}]")


def _read_file(path: str, table: dict[str, UpOption]) -> tuple[dict, dict[str, dict]]:
    """(top-level keys, {pool: its keys}) of a pools file, keys as dests; unknown keys refused."""
    import yaml

    try:
        raw = load_yaml(Path(path).read_text()) or {}
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path}: cannot read the pools file ({getattr(e, 'strerror', None) or e})") from None
    except yaml.YAMLError as e:  # its text spans lines (the offending one, a caret)
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of options at the top level")
    top: dict[str, Any] = {}
    pools: dict[str, dict] = {pool: {} for pool in POOLS}
    base = Path(path).resolve().parent  # relative paths in the file are the file's, not the shell's
    raw, spelled = dests(path, "", raw)
    for k, v in raw.items():
        if k in POOLS and isinstance(v, dict):
            known = ["count", *(["tp"] if k != "encode" else []), *(d for d, u in table.items() if k in u.fields)]
            keys, under = dests(path, f" under {k}", v, pool=k)
            bad = sorted(set(keys) - set(known))
            if bad:
                raise ValueError(f"{path}: unknown key(s) under {k}: {', '.join(bad)}; known: {', '.join(known)}")
            if "count" in keys:
                top[k] = keys.pop("count")
            if "tp" in keys:
                if f"{k}_tp" in raw:
                    raise ValueError(
                        f"{path}: {k}_tp is given twice (as {spelled[f'{k}_tp']} and {k}: {{{under['tp']}: ...}})"
                    )
                top[f"{k}_tp"] = keys.pop("tp")
            pools[k] = resolve_paths(keys, base)
        elif k in OWN or k in table:
            top[k] = v
        else:
            bad = sorted(set(raw) - set(OWN) - set(table))
            raise ValueError(f"{path}: unknown key(s) {', '.join(bad)}; known: {', '.join([*OWN, *table])}")
    return resolve_paths(top, base), pools


def spec_from_args(args: argparse.Namespace, default_model: Callable[[], Any]) -> PoolSpec:
    """The PoolSpec of `up`'s command line and pools file (see the module docstring)."""
    table = up_options()
    top, pools = _read_file(args.config, table) if args.config else ({}, {pool: {} for pool in POOLS})
    cli = {d: v for d in [*OWN, *table] if (v := getattr(args, d)) is not None}

    own = {}
    for d, (typ, default, _) in OWN.items():
        v = cli.get(d, top.get(d, default))
        try:
            if v is None and default is None:  # left to `up` (the built-in model, a token made here)
                own[d] = None
            elif typ in (bool, int, float, str):
                own[d] = read_value(typ, v)
            else:
                own[d] = typ(v)
        except (PortError, NumberError) as e:
            raise ValueError(f"{d}: {e}") from None
        except (TypeError, ValueError):
            raise ValueError(f"{d}: cannot read {v!r} as {getattr(typ, '__name__', typ)}") from None
    opts: dict[str, dict[str, Any]] = {comp: {} for comp in COMPONENTS}
    for d, u in table.items():
        for comp, o in u.fields.items():
            if d in cli:
                opts[comp][o.name] = cli[d]
            elif d in pools.get(comp, {}):
                opts[comp][o.name] = coerce(o, pools[comp][d])
            elif d in top:
                opts[comp][o.name] = coerce(o, top[d])
    from engine.hub import resolve  # noqa: PLC0415

    if (why := unresolved(own["host"])) is not None:  # before any server starts (gRPC would log it first)
        raise ValueError(f"--host {why}")

    model = str(Path(resolve(own["model"]) if own["model"] else default_model()).resolve())
    RouterConfig(model=model, **opts["router"])  # every check (a bad directory too), before anything starts
    engines = {}
    for pool in POOLS:  # each pool's engine settings checked as its nodes will (without torch)
        if pool == "encode" and not own["encode"]:  # one rank; checked only when the pool is on
            continue
        tp = {} if pool == "encode" else {"tensor_parallel_size": own[f"{pool}_tp"]}
        checked = engines[pool] = NODE_CONFIGS[pool](model=model, **tp, **opts[pool]).engine_config(check_only=True)
        if pool == "encode" and checked.model.vision is None:
            raise ValueError(f"--encode {own['encode']}: {model} has no vision tower (or no image processor)")
    if own["prefill"] and own["decode"]:
        _same_state(engines["prefill"], engines["decode"])
    return PoolSpec(
        model=model,
        prefill=own["prefill"],
        decode=own["decode"],
        encode=own["encode"],
        prefill_tp=own["prefill_tp"],
        decode_tp=own["decode_tp"],
        host=own["host"],
        advertise_host=own["advertise_host"],
        port=own["port"],
        log_level=args.log_level or "INFO",
        drain_timeout_s=own["drain_timeout"],
        router_options=opts["router"],
        prefill_options=opts["prefill"],
        decode_options=opts["decode"],
        encode_options=opts["encode"],
        cluster_token=_token(own["cluster_token_file"]),
        insecure_open_cluster=own["insecure_open_cluster"],
        cpu_binding=own["cpu_binding"],
        decode_nice=own["decode_nice"],
        node_start=own["node_start"],
    )


def _token(path: str | None) -> str | None:
    from serving.security import read_token

    raw = read_token(path, {}) if path else None
    return None if raw is None else raw.decode()


def _same_state(pre, dec) -> None:
    """ValueError when the pools differ in a setting the transferred state depends on: the
    handshake would refuse every pair, and the decode nodes compute every prompt themselves."""
    what = {
        "dtype": lambda c: c.model.dtype,
        "mamba_ssm_cache_dtype": lambda c: c.cache.recurrent_dtype,
        "block_size": lambda c: c.cache.block_size,
        "speculative method": lambda c: c.speculative.method if c.speculative.num_tokens else "none",
        "num_speculative_tokens": lambda c: c.speculative.num_tokens,
        "batch_invariant": lambda c: c.model.batch_invariant,
        "rotary scaling (hf_overrides)": lambda c: c.model.rope_scaling,
        "rope_theta (hf_overrides)": lambda c: c.model.rope_theta,
        "partial_rotary_factor (hf_overrides)": lambda c: c.model.partial_rotary_factor,
        "rms_norm_eps (hf_overrides)": lambda c: c.model.rms_norm_eps,
    }
    for name, read in what.items():
        a, b = read(pre), read(dec)
        if name == "mamba_ssm_cache_dtype" and (a, b) == ("float32", "bfloat16"):
            continue  # the one cast a transfer plan declares: the prefill nodes round the state once
        if a != b:
            if name == "mamba_ssm_cache_dtype":
                raise ValueError(
                    f"the prefill and decode pools differ in {name} ({a} vs {b}): a bfloat16 recurrent state "
                    "cannot be handed to a float32 decode node (only float32 prefill -> bfloat16 decode is cast); "
                    "give the decode pool bfloat16 or both the same value"
                )
            raise ValueError(
                f"the prefill and decode pools differ in {name} ({a} vs {b}): a prefill node hands its state "
                "only to decode nodes that match; give both pools the same value"
            )
