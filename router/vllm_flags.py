"""vLLM's spellings of a few options, as users copy them from its Qwen3.5 recipes, rewritten to
pdserve's before the command line is parsed (so `--help` and the errors stay pdserve's):

- `--speculative-config '{"method": "mtp" | "qwen3_next_mtp" | "qwen3_5_mtp" | "ngram",
  "num_speculative_tokens": N}'` -> `--speculative-method`, `--num-speculative-tokens`;
- `--tensor-parallel-size N` / `-tp N` -> `--tp N` for one node, `--prefill-tp N --decode-tp N`
  for `up`;
- `--enable-prefix-caching` / `--no-enable-prefix-caching` -> `--[no-]prefix-caching`;
- `--served-model-name a b ...` (several names after one flag) -> `--served-model-name a
  --served-model-name b ...` (pdserve's repeatable form is taken as it is);
- `--dtype half | bf16 | float` -> `--dtype float16 | bfloat16 | float32`;
- `--enforce-eager` -> `--no-cuda-graphs`;
- `--kv-cache-dtype auto` dropped (the KV cache is kept in the model's dtype); any other value refused;
- `--rope-scaling JSON` and `--rope-theta N` (removed from vLLM, still in recipes) -> `--hf-overrides
  '{"rope_scaling": JSON}'` / `'{"rope_theta": N}'`, the text model's rotary settings
  (engine/config_overrides.py); these and `--hf-overrides` itself, given together, are merged in
  command-line order into one `--hf-overrides` (each checked: not JSON, or not an object, is refused);
- `--trust-remote-code`, `--disable-log-requests`, `--enable-chunked-prefill` dropped, with one
  INFO line saying they have no effect here (`notes`).

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
}
TP = ("--tensor-parallel-size", "-tp")
# flags vLLM's recipes carry that change nothing here: why, for the INFO line
NO_OPS = {
    "--trust-remote-code": "no remote code runs (pdserve's own model classes)",
    "--disable-log-requests": "the router logs one INFO line per request (--log-level WARNING hides them)",
    "--enable-chunked-prefill": "prompts are always chunked (--max-num-batched-tokens)",
}
OVERRIDES = ("--hf-overrides", "--rope-scaling", "--rope-theta")  # merged into one --hf-overrides
VALUED = (*TP, "--speculative-config", "--dtype", "--kv-cache-dtype", *OVERRIDES)  # flags whose value is read here
# pdserve's options each vLLM spelling stands for: both on one command line are refused (`_twice`)
SAME_OPTION = {
    "--tensor-parallel-size": ("--tp", "--prefill-tp", "--decode-tp"),
    "-tp": ("--tp", "--prefill-tp", "--decode-tp"),
    "--speculative-config": ("--speculative-method", "--num-speculative-tokens"),
    "--enable-prefix-caching": ("--prefix-caching", "--no-prefix-caching"),
    "--no-enable-prefix-caching": ("--prefix-caching", "--no-prefix-caching"),
    "--enforce-eager": ("--cuda-graphs", "--no-cuda-graphs"),
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
    out: list[str] = []
    dropped: list[str] = []
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
            out += ["--prefill-tp", value, "--decode-tp", value] if cmd == "up" else ["--tp", value]
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
        elif a == "--served-model-name":  # vLLM's several names after one flag
            names = []
            while i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                names.append(argv[i + 1])
                i += 1
            out += [x for n in names for x in ("--served-model-name", n)] or [a]
        else:
            out.append(RENAMED.get(a, a))
        i += 1
    if dropped and notes is not None:
        notes.append("; ".join(f"{f} has no effect here: {NO_OPS[f]}" for f in dropped))
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
