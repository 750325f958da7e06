"""A model named by its Hugging Face repo id (`ORG/NAME`, as vLLM takes it) rather than a
directory: the snapshot in the local Hugging Face cache, fetched into it first (with the hub's
progress bars) when it is not there and the hub may be reached. A path that exists is left as given
(an error about its content comes from the loader); anything else is refused here, in one line."""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("pdserve.hub")

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what serving reads of a repo: configs, weights, the tokenizer and chat template, the processor
FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def resolve(model: str) -> str:
    """`model` as a directory: itself when it exists, else the repo's cached snapshot (downloaded
    first if need be). FileNotFoundError, saying what to do, when neither (at once for a path that
    is no repo id)."""
    if Path(model).exists():
        return model
    if not REPO_ID.match(model):
        raise FileNotFoundError(f"{model}: no such checkpoint directory (nor a Hugging Face repo id, ORG/NAME)")
    from huggingface_hub import constants, snapshot_download  # noqa: PLC0415 (only for a repo id)

    try:
        return str(snapshot_download(model, allow_patterns=FILES, local_files_only=True))
    except Exception as e:  # noqa: BLE001 (not cached, or cached without a snapshot): fetch it
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(
                f"{model} is neither a checkpoint directory nor a repo in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}; HF_HUB_OFFLINE is set): pass a directory, or fetch the repo first"
            ) from e
    log.info("%s is not a directory: fetching the repo from the Hugging Face Hub into its cache", model)
    try:
        return str(snapshot_download(model, allow_patterns=FILES))
    except Exception as e:  # noqa: BLE001 (the hub's error types vary by failure)
        raise FileNotFoundError(
            f"{model} is neither a checkpoint directory nor a Hugging Face repo this machine could fetch "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): pass a directory, or set "
            "HF_TOKEN for a gated repo (HF_HUB_OFFLINE=1 uses the cache only)"
        ) from None
