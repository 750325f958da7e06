"""The names clients call the model by: `--served-model-name` (the first is the id, the others
aliases), else a default from the checkpoint's path (ORG/NAME for a Hugging Face cache snapshot,
else the directory's name); the path and its last part are accepted too (docs/api.md)."""

from __future__ import annotations

from pathlib import Path

from proto import pb
from router.registry import NodeRegistry
from serving.vllm_metrics import HF_SNAPSHOT, model_id

__all__ = ["model_id", "model_root", "names_of", "served_models"]


def model_root(path: str) -> str:
    """What a model card's `root` names, as vLLM's does (the checkpoint a client loads the tokenizer
    from: `vllm bench serve` without --model reads it): ORG/NAME for a Hugging Face cache snapshot,
    else the checkpoint's path."""
    m = HF_SNAPSHOT.search(path)
    return f"{m.group(1)}/{m.group(2)}" if m else path


def served_models(registry: NodeRegistry, served: tuple[str, ...], has_tokenizer: bool) -> list[pb.ModelInfo]:
    """The models the live nodes serve, each under its id (the first of `served` for the
    router's one model; else `model_id` of its path). Encode nodes are left out: they hold only
    the vision tower (no vocabulary, no context length) and serve no text on their own."""
    seen: dict[str, pb.ModelInfo] = {}
    for e, _ in registry.snapshot():
        if e.info.kind == pb.NODE_KIND_ENCODE:
            continue
        if e.alive and e.info.model and e.info.model not in seen:
            seen[e.info.model] = pb.ModelInfo(
                id=model_id(e.info.model),
                path=e.info.model,
                vocab_size=e.info.vocab_size,
                max_model_len=e.info.max_model_len,
                has_tokenizer=has_tokenizer,
            )
    if served and len(seen) == 1:  # the router fronts one checkpoint: its served names
        next(iter(seen.values())).id = served[0]
    return list(seen.values())


def names_of(m: pb.ModelInfo, served: tuple[str, ...]) -> tuple[str, ...]:
    """Every name a request may call model m by: its id, the served names' aliases, its path and
    the path's last part."""
    aliases = served if m.id in served else ()
    return (m.id, *aliases, m.path, Path(m.path).name)
