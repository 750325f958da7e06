"""The server's default sampling parameters (engine/generation_defaults.py: the checkpoint's
generation_config.json, or --override-generation-config) written into a request's unset fields
before it is checked and placed, whatever front it came through (OpenAI, Anthropic, the gRPC
SDK): a field the client sent is kept; max_tokens is capped (vLLM's max_new_tokens)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.generation_defaults import describe
from proto import pb

if TYPE_CHECKING:
    from router.config import RouterConfig

log = logging.getLogger("pdserve.router")


def load(cfg: RouterConfig) -> dict[str, float | int]:
    """The router's defaults, logged once at start when there are any."""
    d = cfg.sampling_defaults
    if d:
        log.info(
            "default sampling parameters (--generation-config %s): %s; a request's own values win",
            cfg.generation_config,
            describe(d),
        )
    return d


def apply(sp: pb.SamplingParams, defaults: dict[str, float | int]) -> None:
    """`sp` with each default its request left unset; top_k 0 is unset (-1 is the client's "off")."""
    for name, v in defaults.items():
        if name == "max_tokens":
            sp.max_tokens = min(sp.max_tokens, int(v)) if sp.HasField("max_tokens") else int(v)
        elif name == "top_k":
            if sp.top_k == 0:
                sp.top_k = int(v)
        elif not sp.HasField(name):
            setattr(sp, name, v)
