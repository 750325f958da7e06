"""vLLM's spellings of a few options, as users copy them from its Qwen3.5 recipes, rewritten to
pdserve's before the command line is parsed (so `--help` and the errors stay pdserve's):

- `--speculative-config '{"method": "mtp" | "qwen3_next_mtp" | "qwen3_5_mtp" | "ngram",
  "num_speculative_tokens": N}'` -> `--speculative-method`, `--num-speculative-tokens`;
- `--tensor-parallel-size N` / `-tp N` -> `--tp N` for one node, `--prefill-tp N --decode-tp N`
  for `up`;
- `--enable-prefix-caching` / `--no-enable-prefix-caching` -> `--[no-]prefix-caching`.
"""

from __future__ import annotations

import json

MTP = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")
SPEC_KEYS = ("method", "num_speculative_tokens")
RENAMED = {"--enable-prefix-caching": "--prefix-caching", "--no-enable-prefix-caching": "--no-prefix-caching"}
TP = ("--tensor-parallel-size", "-tp")


def rewrite(argv: list[str]) -> list[str]:
    """argv with vLLM's spellings in pdserve's; ValueError naming a value pdserve cannot take."""
    cmd = next((a for a in argv if not a.startswith("-")), "")
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        takes = name in TP or name == "--speculative-config"
        if takes and not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"{name} needs a value")
            value, i = argv[i + 1], i + 1
        if name == "--speculative-config":
            out += _speculative(value)
        elif name in TP:
            out += ["--prefill-tp", value, "--decode-tp", value] if cmd == "up" else ["--tp", value]
        else:
            out.append(RENAMED.get(a, a))
        i += 1
    return out


def _speculative(text: str) -> list[str]:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(
            f"--speculative-config: {', '.join(unknown)} not supported (supported: {', '.join(SPEC_KEYS)})"
        )
    out = []
    method = spec.get("method")
    if method is not None:
        if method in MTP:
            method = "mtp"
        elif method not in ("ngram",):
            raise ValueError(f"--speculative-config method {method!r}: pdserve drafts with {', '.join(MTP)} or ngram")
        out += ["--speculative-method", method]
    n = spec.get("num_speculative_tokens")
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"--speculative-config num_speculative_tokens must be an integer >= 0 (got {n!r})")
        out += ["--num-speculative-tokens", str(n)]
    return out
