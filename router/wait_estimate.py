"""When a request would start, as the router estimates it at arrival: each prefill node's rate
(the one it reports from its own passes, serving/step_rate.py; before its first report, the
`RateMeter` the router keeps from completed prefills), the prompt tokens ahead of the request on
the prefill pool, and the decode nodes' free room now (docs/router.md, "Leases and admission")."""

from __future__ import annotations

import math
import time
from collections import deque

from engine.rate_window import RateWindow
from proto import pb
from router.registry import NodeEntry, NodeRegistry

WINDOW = 16  # completions per prefill node the rate is measured over
# A node measures its rate on its own work; in a burst the decode nodes' work beside it (on the
# same host or PCIe link) and the dispatch gaps take some of it: measured, a float32 burst ran
# at 0.93x what the prefill node had measured one prompt at a time just before (bfloat16: 1.0x).
NODE_RATE_MARGIN = 0.9
LENGTHS_WINDOW = 64  # ended requests the typical output length is taken over
# a placed request's expected output before any request has ended: a chat answer's length, not
# its limit (a request without max_tokens may run to the context's end, and taken at that it
# made a burst of 24 against 16 slots, done in 24 s, estimate 30 s to 170 s and refused 3 of 4)
OUTPUT_PRIOR_TOKENS = 256


class RateMeter:
    """Prompt tokens per second per prefill node over its last `WINDOW` completed prefills: each
    one's tokens over the time since that node's previous completion; the window's tokens over
    its seconds, so prompts that finish in the same step (0 s apart) count their tokens against
    the step before, and one odd interval moves the rate by a 16th, not a quarter as a moving
    average would. The first completion after the node was idle counts only from
    `IDLE_MIN_TOKENS` on: a short prompt sent to an idle node (a client's sequential warm-up)
    measures a round trip, not the rate of a busy node, and would refuse the first real burst."""

    def __init__(self) -> None:
        self._mark: dict[str, float] = {}
        self._idle: set[str] = set()
        self._seen: dict[str, RateWindow] = {}

    def busy(self, node: str, now: float | None = None) -> None:
        """The node had nothing outstanding and is sent a prompt."""
        self._mark[node] = time.monotonic() if now is None else now
        self._idle.add(node)

    def done(self, node: str, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        dt = max(now - self._mark.get(node, now), 0.0)
        self._mark[node] = now
        idle = node in self._idle
        self._idle.discard(node)
        self._seen.setdefault(node, RateWindow(WINDOW)).add(tokens, dt, idle=idle)

    def since(self, node: str, now: float | None = None) -> float:
        """Seconds the node has worked since its last completion (or since it was sent a prompt
        while idle): what it computed of the prompts still outstanding there; 0 when never seen."""
        now = time.monotonic() if now is None else now
        mark = self._mark.get(node)
        return 0.0 if mark is None else max(now - mark, 0.0)

    def keep(self, nodes: set[str]) -> None:
        """Forget the nodes not in `nodes` (the registry forgot them: a pool scaled down, a pod replaced)."""
        for d in (self._mark, self._seen):
            for n in [n for n in d if n not in nodes]:
                del d[n]
        self._idle &= nodes

    def rate(self, node: str) -> float | None:
        """Tokens per second, None before the node's first completion while busy."""
        seen = self._seen.get(node)
        return seen.rate() if seen is not None else None


class OutputLengths:
    """The output tokens of the last `LENGTHS_WINDOW` requests that ended after decoding: how long a
    placed request holds its decode room. A request's expected tokens left are the smaller of what
    its limit leaves and this window's mean, whatever it has already made (no length is read from
    a prompt: past the mean, another mean is as good a guess as any)."""

    def __init__(self) -> None:
        self._seen: deque[int] = deque(maxlen=LENGTHS_WINDOW)

    def ended(self, tokens: int) -> None:
        if tokens > 0:
            self._seen.append(tokens)

    def left(self, made: int, most: int, least: int = 0) -> int:
        """Expected tokens left of a request that made `made` of at most `most` and at least `least`
        (its min_tokens; its max_tokens where nothing but its limit can end it: ignore_eos, no stop
        ids or strings, as benchmark clients send)."""
        typical = sum(self._seen) / len(self._seen) if self._seen else OUTPUT_PRIOR_TOKENS
        return max(0, min(most - made, max(math.ceil(typical), least - made)))


def node_rate(p: NodeEntry, meter: RateMeter, length: int = 0) -> float | None:
    """A prefill node's prompt tokens per second for prompts of `length` tokens (computed from
    the start): `NODE_RATE_MARGIN` of what its fitted cost gives (PrefillCost: a token, and the
    context it attends to; never faster a token than the fastest of the passes it was fitted
    over), else of its own rate, else what the router measured."""
    c = p.info.prefill_cost
    if p.info.HasField("prefill_cost") and (c.s_per_token > 0 or c.s_per_pair > 0):
        return NODE_RATE_MARGIN / max(c.s_per_token_min, c.s_per_token + c.s_per_pair * (length + 1) / 2)
    own = p.info.prefill_tokens_per_s
    return own * NODE_RATE_MARGIN if own else meter.rate(p.node_id)


def decode_room(nodes: list[NodeEntry], prompt_len: int) -> int:
    """Requests of `prompt_len` tokens the decode nodes have room for now (slots and pages)."""
    room = 0
    for d in nodes:
        room += max(0, min(d.est_free_slots(), d.est_free_blocks() // max(1, d.blocks_for(prompt_len + 1))))
    return room


def decode_wait(need: int, ends: list[float]) -> float:
    """Seconds until `need` more requests find room on the decode nodes, from when each placed
    request is expected to end (`ends`, seconds from now; 0 where not known yet): the need-th
    soonest end, and a whole turn of the longest per further round. inf with nothing placed."""
    if not ends:
        return math.inf
    ends = sorted(ends)
    rounds, i = divmod(need - 1, len(ends))
    return ends[i] + rounds * ends[-1]


def estimate(
    registry: NodeRegistry,
    meter: RateMeter,
    prompt_len: int,
    tokens: int,
    ahead_tokens: int,
    ahead: int,
    ahead_squares: int,
    ends: list[float],
    batch: bool = False,
    decode: bool = True,
) -> tuple[float, str]:
    """(seconds until a request starts, what the figure is made of). tokens: what it brings to
    the prefill pool (0: prefilled on the decode node); ahead_tokens / ahead / ahead_squares: the
    pool tokens, the requests and the sum of each one's tokens squared queued before it; ends: when each request placed on a decode node is expected
    to end. The later of the decode room and the prefill pool's turn; 0 where nothing is known
    yet (no decode node, no prefill measured: admitted). An interactive request (not `batch`)
    counts only the interactive prompts outstanding on the pool: the nodes schedule it first.
    decode false: the request takes no decode node (it ends at its first token)."""
    with registry.lock:
        dec = registry.routable(pb.NODE_KIND_DECODE)
        if not dec:
            return 0.0, "no decode node"
        room = decode_room(dec, prompt_len)
        wait, what = 0.0, "decode room"
        if decode and room < ahead + 1:
            wait = decode_wait(ahead + 1 - room, ends)
            what = f"no decode node had room: {ahead} requests wait, room for {room}, {len(ends)} placed"
        if not tokens:
            return wait, what
        pool = [p for p in registry.routable(pb.NODE_KIND_PREFILL) if p.info.prefill_ready]
        # the prompts ahead priced at their length-weighted mean length, sum L^2 / sum L: under the
        # fitted cost (a + b (L + 1) / 2 a token) exactly the sum of their own times. Their plain
        # mean (186 for 40-token prompts with a 1,500-token one in ten, against 1,217) priced such a
        # burst on the tiny model at 6.5 times that rate, and requests told 7 s waited 64 s. An
        # interactive request's are the interactive ones (a batch flood's long prompts, which its
        # node computes after it, would price its short ones ahead at their length)
        if batch:
            sent = sum(p.inflight_prefill_tokens for p in pool), sum(p.inflight_prefill_squares for p in pool)
        else:
            sent = sum(p.inflight_interactive_tokens for p in pool), sum(p.inflight_interactive_squares for p in pool)
        tokens_ahead, squares = sent[0] + ahead_tokens, sent[1] + ahead_squares
        length = squares // tokens_ahead if tokens_ahead else prompt_len
        rates = {p.node_id: node_rate(p, meter, length) for p in pool}
        measured = [r for r in rates.values() if r is not None]
        if not measured:
            return wait, what + "; no prefill measured yet"
        # a node not measured yet counts at the mean rate of those that are
        rate = sum(measured) / len(measured) * len(pool)
        if batch:
            outstanding = sum(p.queued_prefill_tokens() for p in pool)
        else:
            # the router counts a prompt in full until its first token: take off what each node
            # computed of them since its last completion (a long prompt half done waits half)
            now = time.monotonic()
            outstanding = sum(
                max(0, p.inflight_interactive_tokens - int((rates[p.node_id] or 0.0) * meter.since(p.node_id, now)))
                for p in pool
            )
    work = outstanding + ahead_tokens
    pre = work / rate
    pre_what = f"{work:,} prompt tokens ahead at {rate:,.0f} tokens/s"
    return (wait, what) if wait > pre else (pre, pre_what)
