"""vLLM's spellings of a few options, as users copy them from its Qwen3.5 recipes, rewritten to
pdserve's before the command line is parsed (so `--help` and the errors stay pdserve's):

- `--speculative-config '{"method": "mtp" | "qwen3_next_mtp" | "qwen3_5_mtp" | "ngram",
  "num_speculative_tokens": N}'` -> `--speculative-method`, `--num-speculative-tokens`;
- `--tensor-parallel-size N` / `-tp N` -> `--tp N` for one node, `--prefill-tp N --decode-tp N`
  for `up`;
- `serve` is `up` as vLLM's command line has it: the model as its first word (`vllm serve MODEL`),
  `--port` the OpenAI HTTP port (8000 when not given) and `--grpc-port` the router's (`up`'s `--port`);
- `--enable-prefix-caching` / `--no-enable-prefix-caching` -> `--[no-]prefix-caching`;
- `--served-model-name a b ...` (several names after one flag) -> `--served-model-name a
  --served-model-name b ...` (pdserve's repeatable form is taken as it is);
- `--dtype half | bf16 | float` -> `--dtype float16 | bfloat16 | float32`;
- `--enforce-eager` -> `--no-cuda-graphs`;
- `--ssl-certfile`, `--ssl-keyfile`, `--ssl-ca-certs` -> `--tls-cert`, `--tls-key`, `--tls-ca` (TLS
  on the router's gRPC and HTTP ports, and between the components);
- `--kv-cache-dtype auto` dropped (the KV cache is kept in the model's dtype); any other value refused;
- `--rope-scaling JSON` and `--rope-theta N` (removed from vLLM, still in recipes) -> `--hf-overrides
  '{"rope_scaling": JSON}'` / `'{"rope_theta": N}'`, the text model's rotary settings
  (engine/config_overrides.py); these and `--hf-overrides` itself, given together, are merged in
  command-line order into one `--hf-overrides` (each checked: not JSON, or not an object, is refused);
- `--limit-mm-per-prompt '{"image": N}'` -> `--max-images-per-request N`; `--language-model-only`
  -> `--max-images-per-request 0` (images refused; the vision tower is still loaded);
- flags of its recipes that change nothing here (`NO_OPS`: `--trust-remote-code`,
  `--enable-expert-parallel`, `--async-scheduling`, ...; `VALUED_NO_OPS`, with their value:
  `--mm-encoder-tp-mode data`, `--load-format safetensors`, ...) dropped, with one INFO line saying
  why (`notes`); a value that would change something (`--load-format gguf`) is refused;
- `--data-parallel-size` / `-dp` refused, naming what scales out here (`REFUSED`).

`--generation-config`, `--override-generation-config` and `--default-chat-template-kwargs` are
pdserve's own options under vLLM's names (router/config.py).

A vLLM spelling given beside pdserve's own spelling of the same option (`-tp 2 --decode-tp 1`,
`--speculative-config ... --num-speculative-tokens 3`) is refused as given twice, as in a pools
file: the parser would silently keep whichever came last.

The subcommand is the first word that is neither an option nor the value of a global option
(`GLOBAL_VALUED`: `pdserve --log-level DEBUG up ...`).
"""

from __future__ import annotations

RENAMED = {
    "--enable-prefix-caching": "--prefix-caching",
    "--no-enable-prefix-caching": "--no-prefix-caching",
    "--enforce-eager": "--no-cuda-graphs",
    # vLLM's TLS for its HTTP server; pdserve's serves gRPC and HTTP with it
    "--ssl-certfile": "--tls-cert",
    "--ssl-keyfile": "--tls-key",
    "--ssl-ca-certs": "--tls-ca",
}
TP = ("--tensor-parallel-size", "-tp")
# flags vLLM's recipes carry that change nothing here: why, for the INFO line
NO_OPS = {
    "--trust-remote-code": "no remote code runs (pdserve's own model classes)",
    "--disable-log-requests": "the router logs one INFO line per request (--log-level WARNING hides them)",
    "--enable-log-requests": "the router logs one INFO line per request (--log-level WARNING hides them)",
    "--enable-chunked-prefill": "prompts are always chunked (--max-num-batched-tokens)",
    "--disable-uvicorn-access-log": "the HTTP front keeps no access log; the router's request lines stand in",
    "--async-scheduling": "the decode node schedules its steps its own way (docs/engine.md)",
    "--enable-expert-parallel": "routed experts are split over the tensor-parallel ranks (docs/engine.md)",
    "--disable-custom-all-reduce": "the ranks' all-reduce is pdserve's own",
}
# flags of vLLM's that take a value and change nothing here: the values taken (None: any), why
VALUED_NO_OPS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "--uvicorn-log-level": (None, "the HTTP front logs at --log-level"),
    "--mm-processor-cache-type": (None, "the router keeps its own cache of prepared images (docs/images.md)"),
    "--mm-encoder-tp-mode": (("data", "weights"), "the vision tower runs where pdserve places it (docs/images.md)"),
    "--distributed-executor-backend": (("mp", "uni"), "tensor-parallel ranks are local processes"),
    "--swap-space": (None, "no CPU swap space is kept for preempted requests"),
    "--tokenizer-mode": (("auto", "hf"), "the checkpoint's tokenizer.json is read"),
    "--load-format": (("auto", "safetensors"), "weights load from the checkpoint's safetensors"),
    "--quantization": (
        ("fp8",),
        "the checkpoint's own quantization_config is read (FP8 as published); a bfloat16 checkpoint is not "
        "quantized at load",
    ),
    "--max-logprobs": (None, "up to 20 alternatives per token are returned (OpenAI's limit)"),
    "--compilation-config": (None, "CUDA graphs are --cuda-graphs / --no-cuda-graphs (docs/gpu.md)"),
    "--kv-transfer-config": (None, "prefill and decode pools hand state over through pdserve's own transfer layer"),
}
# vLLM's flags with no counterpart here, and what to do instead
REFUSED = {
    "--data-parallel-size": "pdserve scales out by node count: --decode N (and --prefill N)",
    "-dp": "pdserve scales out by node count: --decode N (and --prefill N)",
}
OVERRIDES = ("--hf-overrides", "--rope-scaling", "--rope-theta")  # merged into one --hf-overrides
# flags whose value is read here
VALUED = (
    *TP,
    "--speculative-config",
    "--dtype",
    "--kv-cache-dtype",
    *OVERRIDES,
    *VALUED_NO_OPS,
    *REFUSED,
    "--limit-mm-per-prompt",
)
# pdserve's options each vLLM spelling stands for: both on one command line are refused (`_twice`)
SAME_OPTION = {
    "--tensor-parallel-size": ("--tp", "--prefill-tp", "--decode-tp"),
    "-tp": ("--tp", "--prefill-tp", "--decode-tp"),
    "--speculative-config": ("--speculative-method", "--num-speculative-tokens"),
    "--enable-prefix-caching": ("--prefix-caching", "--no-prefix-caching"),
    "--no-enable-prefix-caching": ("--prefix-caching", "--no-prefix-caching"),
    "--enforce-eager": ("--cuda-graphs", "--no-cuda-graphs"),
    "--limit-mm-per-prompt": ("--max-images-per-request", "--language-model-only"),
    "--language-model-only": ("--max-images-per-request",),
    "--ssl-certfile": ("--tls-cert",),
    "--ssl-keyfile": ("--tls-key",),
    "--ssl-ca-certs": ("--tls-ca",),
}
GLOBAL_VALUED = ("--log-level",)  # pdserve's options before the subcommand that take a value (cli.build_parser)


def subcommand(argv: list[str]) -> str:
    """The subcommand: the first word that is not an option or a global option's value ("" if none)."""
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in GLOBAL_VALUED:
            skip = True
        elif not a.startswith("-"):
            return a
    return ""


def rewrite(argv: list[str], notes: list[str] | None = None) -> list[str]:
    """argv with vLLM's spellings in pdserve's; ValueError naming a value pdserve cannot take.
    `notes` (if given) gets one line naming the flags dropped because they have no effect here."""
    _twice(argv)
    cmd = subcommand(argv)
    if cmd == "serve":
        argv = _serve_ports(argv)
    out: list[str] = []
    dropped: list[str] = []
    notes_valued: list[str] = []
    overrides: dict | None = None  # every override flag's, merged, at the first one's place (`at`)
    at = 0
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if name in VALUED and not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"{name} needs a value")
            value, i = argv[i + 1], i + 1
        if name == "--speculative-config":
            out += _speculative(value)
        elif name in TP:
            out += ["--prefill-tp", value, "--decode-tp", value] if cmd in ("up", "serve") else ["--tp", value]
        elif name == "--dtype":
            from engine.config_fields import DTYPE_ALIASES  # noqa: PLC0415 (the engine's package: imported once argv is read)

            out += ["--dtype", DTYPE_ALIASES.get(value, value)]
        elif name in OVERRIDES:
            if overrides is None:
                at, overrides = len(out) + 1, {}
                out.append(OVERRIDES[0])
            overrides = _override(name, value, overrides)
        elif name == "--kv-cache-dtype":
            if value != "auto":
                raise ValueError(
                    f"--kv-cache-dtype {value}: pdserve keeps the KV cache in the model's dtype (--dtype); only auto"
                )
        elif a in NO_OPS:
            dropped.append(a)
        elif name in VALUED_NO_OPS:
            taken, why = VALUED_NO_OPS[name]
            if taken is not None and value not in taken:
                raise ValueError(f"{name} {value}: pdserve takes {' or '.join(taken)} only ({why})")
            notes_valued.append(f"{name} has no effect here: {why}")
        elif name in REFUSED:
            raise ValueError(f"{name}: {REFUSED[name]}")
        elif name == "--limit-mm-per-prompt":
            out += _mm_limits(value)
        elif a == "--language-model-only":  # requests with images are refused, as vLLM's
            out += ["--max-images-per-request", "0"]
            notes_valued.append("--language-model-only: images are refused; the nodes still load the vision tower")
        elif a == "--served-model-name":  # vLLM's several names after one flag
            names = []
            while i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                names.append(argv[i + 1])
                i += 1
            out += [x for n in names for x in ("--served-model-name", n)] or [a]
        else:
            out.append(RENAMED[name] + eq + value if name in RENAMED else a)
        i += 1
    said = [f"{f} has no effect here: {NO_OPS[f]}" for f in dropped] + notes_valued
    if said and notes is not None:
        notes.append("; ".join(said))
    if overrides is not None:
        import json

        out.insert(at, json.dumps(overrides, separators=(",", ":")))
    return out


def _override(flag: str, value: str, merged: dict) -> dict:
    """`merged` with one override flag's value merged in; ValueError naming the flag for a bad value."""
    from engine import config_overrides as co  # noqa: PLC0415 (the engine's package: imported once argv is read)

    if flag == "--rope-theta":
        try:
            theta = float(value)
        except ValueError:
            raise ValueError(f"--rope-theta {value!r} is not a number") from None
        if not theta > 0 or theta == float("inf"):
            raise ValueError(f"--rope-theta {value!r} must be a positive number")
        return co.merge(merged, {"rope_theta": theta})
    over = co.parse(value, flag)
    return co.merge(merged, {"rope_scaling": over} if flag == "--rope-scaling" else over)


def _serve_ports(argv: list[str]) -> list[str]:
    """`serve` speaks vLLM's ports: `--port` is the OpenAI HTTP port (8000 when none is given),
    `--grpc-port` the router's gRPC port (`up`'s `--port`)."""
    names = {a.partition("=")[0] for a in argv}
    if "--port" in names and "--http-port" in names:
        raise ValueError("serve: --port is the HTTP port there, as vLLM's, and --http-port sets it too: give one")
    out = []
    for a in argv:
        name, eq, value = a.partition("=")
        out.append({"--port": "--http-port", "--grpc-port": "--port"}.get(name, name) + eq + value)
    return out if names & {"--port", "--http-port"} else [*out, "--http-port", "8000"]


def image_limit(value: object, where: str = "--limit-mm-per-prompt") -> int | None:
    """vLLM's limit_mm_per_prompt (JSON text or a mapping) as the images a request may carry, for
    `--max-images-per-request` (None: it names no image count; no other modality is served, so a
    video count is checked and has nothing to limit)."""
    from engine.json_text import json_value  # noqa: PLC0415 (the engine's package: imported once argv is read)
    from engine.llm_vllm import mm_limits  # noqa: PLC0415

    return mm_limits(json_value(value, where)).get("image")


def _mm_limits(text: str) -> list[str]:
    n = image_limit(text)
    return [] if n is None else ["--max-images-per-request", str(n)]


def _twice(argv: list[str]) -> None:
    """ValueError when a vLLM spelling and pdserve's spelling of the same option are both given."""
    names = {a.partition("=")[0] for a in argv if a.startswith("-")}
    for theirs, ours in SAME_OPTION.items():
        both = [o for o in ours if o in names]
        if theirs in names and both:
            raise ValueError(f"{theirs} and {both[0]} set the same option: give one of them")


def _speculative(text: str) -> list[str]:
    return [x for k, v in speculative(text).items() for x in ("--" + k.replace("_", "-"), str(v))]


def speculative(spec: object, where: str = "--speculative-config") -> dict[str, str | int]:
    """vLLM's speculative config as pdserve's options (engine/llm_vllm.py reads it for the
    command line, pools files and `LLM(speculative_config=...)` alike). Imported here, not at the
    top: the command line reports an engine that fails to import on its own (cli.py)."""
    from engine.llm_vllm import speculative as read  # noqa: PLC0415

    return read(spec, where)
