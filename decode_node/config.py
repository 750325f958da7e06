"""DecodeNodeConfig: what one decode node runs (engine sizes) and how it joins the router.

Every field is an option of `pdserve decode` and `pdserve up` (engine/options.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.device_defaults import default_local_prefill_step_tokens
from engine.options import option
from serving.config import NodeArgs


@dataclass(frozen=True)
class DecodeNodeConfig(NodeArgs):
    """The engine (EngineArgs: model, sizes, speculative drafts, ...), how the node joins the router
    (NodeArgs), and the decode node's own settings."""

    node_id: str = option("decode-0", "unique among the router's nodes")
    local_prefill_threshold: int = option(
        0,
        "prompts shorter than this many tokens are prefilled here (0: always the prefill pool, when a prefill "
        "node is ready; the router also prefills here when none is)",
    )
    local_resume_threshold: int = option(
        256,
        "a prompt that resumes a prefix this node holds (a conversation's next turn) with fewer new tokens than "
        "this is prefilled here, where its state is (0: only --local-prefill-threshold decides)",
    )
    local_prefill_step_tokens: int | None = option(
        None,
        "prompts this node takes by --local-prefill-threshold or --local-resume-threshold are computed at most this "
        "many tokens a step altogether, each whole, so a burst of follow-up turns neither stalls the streams decoding "
        "here nor makes every one of them wait for the longest step (default 128 on cpu, 2048 on cuda; 0: no cap); "
        "only while a prefill node is ready for this node (without one, every prompt is its own)",
    )
    yield_to_prefill_ms: float = option(
        0.0,
        "on CPUs shared with prefill nodes: while a prompt reserved here is still computed or pushed, hold decode "
        "steps back up to this many milliseconds after the last one, so the prompt gets the CPUs first (0: off; "
        "`up` sets 50 where its nodes share the CPUs)",
    )
    reservation_lease_s: float = option(30.0, "seconds a reservation lives unrenewed when Reserve names no lease",
                                        flag="--default-reservation-lease")  # fmt: skip

    # Drain hand-off (docs/router.md "Migration"): 0 keeps the plain drain (finish every stream,
    # up to --drain-timeout); > 0 hands the streams still running after this long to the router,
    # which moves them to other decode nodes, so a rolling upgrade waits seconds, not the longest stream.
    drain_handoff_s: float = option(
        0.0,
        "on SIGTERM, streams still running after this many seconds are handed off (ended UNAVAILABLE, draining: "
        "the router moves them to another decode node with the tokens sent; with no other decode node up, they "
        "finish here); 0: finish them here",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.yield_to_prefill_ms < 0:
            raise ValueError(f"yield_to_prefill_ms must be >= 0 (got {self.yield_to_prefill_ms})")
        if self.drain_handoff_s < 0:
            raise ValueError(f"drain_handoff_s must be >= 0 (got {self.drain_handoff_s})")
        if self.local_prefill_step_tokens is not None and self.local_prefill_step_tokens < 0:
            raise ValueError(f"local_prefill_step_tokens must be >= 0 (got {self.local_prefill_step_tokens})")
        if self.local_resume_threshold < 0:
            raise ValueError(f"local_resume_threshold must be >= 0 (got {self.local_resume_threshold})")
        if self.local_prefill_threshold < 0:
            raise ValueError(f"local_prefill_threshold must be >= 0 (got {self.local_prefill_threshold})")
        if self.reservation_lease_s <= 0:
            raise ValueError(f"reservation_lease_s must be positive (got {self.reservation_lease_s})")

    def engine_config(self, check_only: bool = False) -> EngineConfig:
        """The engine's, with the short-prompt cap of the prompts the thresholds keep here."""
        cfg = super().engine_config(check_only)
        cap = self.local_prefill_step_tokens
        if cap is None:
            cap = default_local_prefill_step_tokens(self.device)
        short = max(self.local_prefill_threshold, self.local_resume_threshold) if cap else 0
        sched = dataclasses.replace(cfg.scheduler, short_prompt_tokens=short, short_step_tokens=cap)
        return dataclasses.replace(cfg, scheduler=sched)
