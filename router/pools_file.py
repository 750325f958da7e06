"""`pdserve up --config FILE`, the pools file read into keys: YAML read strictly (a key given twice
is refused), keys as option names (`max-model-len` is `max_model_len`), vLLM's spellings of the
options its command line takes too (router/vllm_flags.py) as pdserve's (`hf_overrides` a mapping or
its JSON text), and relative paths in it
resolved from the file's own directory, as compose files and Kubernetes manifests do. What the
keys mean and which win is router/pools.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from router.vllm_flags import NO_OPS, VALUED_NO_OPS, image_limit, speculative

# options whose value is a file or directory: a relative one is read from the pools file's directory
PATH_KEYS = ("cluster_token_file", "tls_cert", "tls_key", "tls_ca", "api_key_file")
# vLLM's keys (its `--config` YAML and recipes) -> pdserve's; a dict value: per value
RENAMED = {"enable_prefix_caching": "prefix_caching"}
DTYPE_KEY = "dtype"


def key(k: Any) -> str:
    return str(k).replace("-", "_")


def load_yaml(text: str) -> Any:
    """yaml.safe_load, but a key given twice in one mapping is an error: PyYAML keeps the last
    silently, so a second `decode:` further down replaced the first unseen."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
        loader.flatten_mapping(node)  # `<<:` merges, as safe_load does them
        seen: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            k = loader.construct_object(key_node, deep=True)
            if k in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{k} is given twice", key_node.start_mark)
            seen[k] = loader.construct_object(value_node, deep=True)
        return seen

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=Loader)  # a SafeLoader: no Python objects


def dests(path: str, where: str, mapping: dict, pool: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """A mapping's keys as dests (`max-model-len` -> `max_model_len`), vLLM's spellings as pdserve's
    (`tensor-parallel-size` -> `prefill_tp` and `decode_tp` at the top, `tp` under a pool); two
    spellings of one option refused naming both. Also each dest's key as the file spells it."""
    out: dict[str, Any] = {}
    spelled: dict[str, Any] = {}

    def put(d: str, v: Any, k: Any) -> None:
        if d in out:
            raise ValueError(f"{path}: {d} is given twice{where} (as {spelled[d]} and {k})")
        out[d], spelled[d] = v, k

    for k, v in mapping.items():
        for d, value in _vllm_key(path, key(k), v, pool):
            put(d, value, k)
    return out, spelled


def _vllm_key(path: str, k: str, v: Any, pool: str | None) -> list[tuple[str, Any]]:
    """(dest, value) pairs that vLLM's key `k` stands for; `k` itself when it is pdserve's."""
    if k == "tensor_parallel_size":
        return [("tp", v)] if pool else [("prefill_tp", v), ("decode_tp", v)]
    if k == "enforce_eager":
        if not isinstance(v, bool):
            raise ValueError(f"{path}: enforce_eager: {v!r} is not true or false")
        return [("cuda_graphs", not v)]
    if k == "kv_cache_dtype":
        if v != "auto":
            raise ValueError(f"{path}: kv_cache_dtype {v}: pdserve keeps the KV cache in the model's dtype; only auto")
        return []
    if k == "hf_overrides":  # a mapping, or its JSON text (as on the command line)
        from engine.config_overrides import text  # noqa: PLC0415

        over = text(v, f"{path}: hf_overrides")
        return [] if over is None else [(k, over)]
    if k in ("override_generation_config", "default_chat_template_kwargs") and isinstance(v, dict):
        return [(k, json.dumps(v))]  # a mapping, or its JSON text (as on the command line)
    if k == "speculative_config":
        return list(speculative(v, f"{path}: speculative_config").items())
    if (flag := "--" + k.replace("_", "-")) in NO_OPS:
        logging.getLogger("pdserve.cli").info("%s: %s has no effect here: %s", path, k, NO_OPS[flag])
        return []
    if flag in VALUED_NO_OPS:
        taken, why = VALUED_NO_OPS[flag]
        if taken is not None and v not in taken:
            raise ValueError(f"{path}: {k} {v}: pdserve takes {' or '.join(taken)} only ({why})")
        logging.getLogger("pdserve.cli").info("%s: %s has no effect here: %s", path, k, why)
        return []
    if k == "limit_mm_per_prompt":
        n = image_limit(v, f"{path}: limit_mm_per_prompt")
        return [] if n is None else [("max_images_per_request", n)]
    if k == "language_model_only":
        return [("max_images_per_request", 0)] if v else []
    if k == DTYPE_KEY and isinstance(v, str):
        from engine.config_fields import DTYPE_ALIASES  # noqa: PLC0415 (the engine's package: once a file is read)

        v = DTYPE_ALIASES.get(v, v)
    return [(RENAMED.get(k, k), v)]


def resolve_paths(keys: dict[str, Any], base: Path) -> dict[str, Any]:
    """`keys` with relative paths read from `base` (the pools file's directory): the PATH_KEYS, a
    chat template given as a file, and the model unless it is a Hugging Face repo id (ORG/NAME)
    that names no directory there."""
    from engine.hub import REPO_ID  # noqa: PLC0415

    out = dict(keys)
    for k, v in keys.items():
        if not isinstance(v, str) or not v:
            continue
        p = Path(v).expanduser()
        if p.is_absolute():
            out[k] = str(p)
        elif k in PATH_KEYS:
            out[k] = str(base / p)
        elif k == "chat_template" and "{{" not in v and "{%" not in v:
            out[k] = str(base / p)
        elif k == "model" and ((base / p).exists() or not REPO_ID.match(v)):
            out[k] = str(base / p)
    return out
