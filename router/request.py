"""One request through the router as an async generator of `Chunk`s: admit -> prefill -> decode ->
relay, admitted again elsewhere when a decode node drains or is unreachable before the first
token, and moved with the tokens sent so far when it fails mid-stream (router/migrate.py);
unwinding cancels the node calls and releases an unactivated reservation."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from proto import pb
from router.detok import IncrementalDetokenizer
from router.errors import NO_DECODE, Abort, DecodeFailed
from router.migrate import Migration, Moved, NodeLost, NodeWatch, Tried
from router.push import Push
from router.registry import NodeEntry
from router.token_mux import Route, merged
from router.wait_estimate import OutputLengths
from serving.rpc import gave_memory_up, is_draining

log = logging.getLogger("pdserve.router")


@dataclass(slots=True)
class Chunk:
    """One event of a request's stream, as both front ends read it."""

    token_ids: Sequence[int]
    text: str = ""
    finish_reason: str = ""  # "" until the last chunk
    logprobs: Sequence[pb.TokenLogprob] = ()
    prompt_logprobs: Sequence[pb.TokenLogprob] = ()
    timings: pb.Timings = field(default_factory=pb.Timings)
    request_id: str = ""
    first: bool = False  # the first chunk: prompt_tokens and the nodes below are set
    prompt_tokens: int = 0
    prompt_token_ids: Sequence[int] = ()  # the first chunk: the prompt as the nodes got it (images expanded)
    cached_tokens: int = 0  # prompt tokens the prefilling node took from its prefix cache
    decode_node: str = ""
    prefill_node: str = ""
    stop: str = ""  # the last chunk of a request a stop string ended: that string
    # each token's share of `text` (joined, `text`), where the chunk has several tokens (a step
    # that accepted drafts): a stop string completed by one of them cuts the tokens after it
    token_text: Sequence[str] = ()


# the finishes that are the cluster's failure, not the client's: their log line is a WARNING
SERVER_FAULTS = ("UNAVAILABLE", "INTERNAL", "ABORTED", "UNKNOWN", "DATA_LOSS")


@dataclass
class Trace:
    """What the per-request log line reports."""

    request_id: str
    received: float = field(default_factory=time.monotonic)
    prompt_len: int = 0
    images: int = 0  # images in the prompt (their tokens are in prompt_len)
    decode: str = "-"
    prefill: str = "-"  # the prefill node; "local": computed on the decode node; "-": not placed
    queue_s: float = 0.0
    estimate_s: float | None = None  # admission's estimate at arrival of the wait to start
    first: float | None = None
    last: float | None = None
    n: int = 0
    finish: str = "-"
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    reserve_s: float | None = None  # 1P+1D: the handshake and reservation on D before the Prefill call
    moves: str = ""  # where it moved mid-stream: "decode-0(unavailable@12) ..."

    def stopped(self, dropped: int) -> None:
        """A stop string ended it; the `dropped` tokens after the match are not its output."""
        self.finish, self.n = "stop", self.n - dropped

    def outcome(self) -> str:
        if self.finish in ("stop", "length"):
            return "ok"
        if self.finish in ("cancelled", "abort", "CANCELLED", "-"):
            return "cancelled"
        return "error"

    def ttft(self) -> float | None:
        return self.first - self.received if self.first else None

    def tpot(self) -> float | None:
        return (self.last - self.first) / (self.n - 1) if self.n > 1 else None

    def log(self) -> None:
        """One line at INFO; at WARNING when the cluster failed it (not the client's request)."""
        ttft, tpot = self.ttft(), self.tpot()
        log.log(
            logging.WARNING if self.finish in SERVER_FAULTS else logging.INFO,
            "request %s: prompt %d%s, decode %s, prefill %s, queue %.1f ms (estimated %s), %sttft %s, tpot %s, "
            "%d tokens, %s; transfer %d B in %.1f ms%s",
            self.request_id,
            self.prompt_len,
            f" ({self.images} image{'s' if self.images > 1 else ''})" if self.images else "",
            self.decode,
            self.prefill,
            self.queue_s * 1e3,
            "-" if self.estimate_s is None else f"{self.estimate_s * 1e3:.1f} ms",
            "" if self.reserve_s is None else f"reserve {self.reserve_s * 1e3:.1f} ms, ",
            "-" if ttft is None else f"{ttft * 1e3:.1f} ms",
            "-" if tpot is None else f"{tpot * 1e3:.1f} ms",
            self.n,
            self.finish,
            self.transfer_bytes,
            self.transfer_s * 1e3,
            f"; moved from {self.moves}" if self.moves else "",
        )


def _first_message(f: pb.PrefillResponse) -> pb.GenerateResponse:
    """A prefill node's first message (the first token, its logprobs) as a decode node's."""
    return pb.GenerateResponse(
        token_ids=[f.first_token_id],
        finish_reason=f.finish_reason,
        timings=f.timings,
        logprobs=f.logprobs,
        cached_tokens=f.cached_tokens,
    )


class _Retry(Exception):
    """Place the request again (on another decode node)."""


# admission's time per output token before any is measured: a decode step of a loaded node
TPOT_PRIOR_S = 0.02
MAX_RENAMES = 2  # times a request goes on under a new id on the nodes (a node held its id still)


class RequestRun:
    """The phases of one request; `svc` is the GenerateService (admission, decode counters,
    prefill phase, registry, tokenizer)."""

    def __init__(
        self, svc, request: pb.GenerateRequest, ids: list[int], trace: Trace, images: Sequence[pb.ImageInput] = ()
    ):
        self.svc, self.request, self.ids, self.tr = svc, request, ids, trace
        self.images = images  # the prompt's, for the node that prefills it (never a reserved decode)
        # a resumed stream (GenerateRequest.resume_token_ids, the SDK on its next router) goes on
        # from the tokens the client has: they are its output so far
        resume = list(request.resume_token_ids)
        skip = not request.sampling.HasField("skip_special_tokens") or request.sampling.skip_special_tokens
        self.detok = IncrementalDetokenizer(svc.tokenizer, ids, skip) if svc.tokenizer is not None else None
        # the client has their text (less what stop strings held back): the next delta follows it
        self.resumed_text = self.detok.push(resume) if self.detok is not None and resume else ""
        self.tried = Tried()  # the decode nodes it was placed on (a restarted one may take it again)
        self.max_new = 0  # new tokens at most, once placed
        sp = request.sampling
        # P returns the first token's logprobs, not the prompt's: those are computed where they are sent
        self.local = sp.HasField("prompt_logprobs")
        self.sent: list[int] = resume  # the tokens relayed so far: a moved request's output
        self.migration = Migration(svc.cfg.max_migrations, svc.migrations)
        self.push: Push | None = None  # the prefill node's push, kept for its figures after a move
        self.own_tokens = 0  # prompt tokens the decode node computes itself, counted in its queue
        self.alone_failed = False  # computing it on a prefill node alone failed once: the usual way
        self.node_ended = 0  # the decode node's count of ended requests once this one ended (0: unknown)
        # its id on the nodes: the client's, until a node still holds that (`_renamed`)
        self.node_rid = trace.request_id
        self.renames = 0

    async def chunks(self) -> AsyncIterator[Chunk]:
        while True:
            if self.sent and len(self.sent) >= self._max_tokens():  # its last message was lost
                yield self._relay(pb.GenerateResponse(finish_reason="length"), None, first=False)
                return
            # a moved request is placed by prompt + output (what the new node computes) and
            # prefilled there (a prefill node samples a prompt's first token, not the next one)
            ids = self.ids + self.sent
            t0 = time.monotonic()
            # it ends at its first token: a prefill node computes it with no decode node
            alone = not (self.local or self.sent or self.alone_failed) and self._max_tokens() == 1
            try:
                d, p, self.own_tokens = await self.svc.admit(
                    ids,
                    self.tried,
                    self.local or bool(self.sent),
                    self.request,
                    resumed=bool(self.tried) or self.alone_failed,
                    trace=self.tr,
                    images=self.images,
                    alone=alone,
                )
            except Abort as a:  # no node took it again: say it had streamed and moved
                if self.migration.count:
                    a.msg += f" (after {len(self.sent)} tokens; moved {self.migration.count} time(s): {self.tr.moves})"
                raise
            finally:  # a client that left the queue waited too (its INFO line says how long)
                self.tr.queue_s += time.monotonic() - t0
            if d is None:
                assert p is not None
                first = await self.svc.prefill.alone(p, self.request, self.ids, self.tr.request_id, self.images)
                if first is None:  # the prefill node failed it: placed again, the usual way
                    self.alone_failed = True
                    continue
                self.max_new, self.tr.prefill = 1, p[0].node_id
                yield self._relay(_first_message(first), None, first=True, prefill_node=p[0].node_id)
                return
            self.tr.decode = d.node_id
            self.tried.add(d)
            self.max_new = min(self._max_tokens(), max(1, d.info.max_model_len - len(self.ids)))
            self.svc.placed.add(self)
            self.node_ended = 0
            try:
                async for c in self._attempt(d, p):
                    yield c
                return
            except Moved as mv:
                self.tr.moves = " ".join(self.migration.path)
                log.warning(
                    "request %s: node %s failed after %d tokens (%s): moving it (%d of at most %d)",
                    self.tr.request_id, mv.node_id, len(self.sent), self.migration.path[-1],
                    self.migration.count, self.migration.limit,
                )  # fmt: skip
                continue
            except _Retry:
                continue
            finally:
                self.svc.placed.discard(self)
                self.svc.done(d, len(ids), self.node_ended)
                self._own_given_back(d)

    def _own_given_back(self, d: NodeEntry) -> None:
        """The prompt tokens D computes itself leave its queue estimate (once: at the first token,
        or when the attempt ends without one)."""
        if self.own_tokens:
            self.svc.local_prefill_done(d, self.own_tokens)
            self.own_tokens = 0

    def _max_tokens(self) -> int:
        from engine.sampling_params import SamplingParams
        from proto.convert import sampling_kwargs

        return int(SamplingParams(**sampling_kwargs(self.request.sampling)).max_tokens)

    def expected_end_s(self, tpot_s: float | None, lengths: OutputLengths) -> float:
        """Seconds until this placed request is expected to end: its expected tokens left (`lengths`:
        the recent requests' typical output, within its own limit) at its own time per token, else
        `tpot_s` (the router's last measured), else TPOT_PRIOR_S."""
        tp = self.tr.tpot() or tpot_s or TPOT_PRIOR_S
        sp = self.request.sampling
        only_its_limit = sp.ignore_eos and not sp.stop_token_ids and not sp.stop
        least = self.max_new if only_its_limit else sp.min_tokens
        return lengths.left(self.tr.n, self.max_new, least) * tp

    async def _attempt(self, d: NodeEntry, p: tuple[NodeEntry, int] | None) -> AsyncIterator[Chunk]:
        """Prefill (on P, with the tokens admission counted against it; or none), then D's stream,
        relayed."""
        pre: Push | None = None
        call = None
        settled = False  # the reservation (if any) is activated, released or never made
        rid, sp, ids = self.node_rid, self.request.sampling, self.ids
        watch: NodeWatch | None = None
        route: Route | None = None  # the request's tokens on the node's token stream
        try:
            if p is not None:
                self.tr.prefill = p[0].node_id  # the node computing it (a cancel during prefill names it)
                pre = await self.svc.prefill.run(d, p, self.request, ids, rid, self.images)
                self.push = pre
            route = d.mux.route(rid if pre is None else pre.rid)
            stream = "" if route is None else route.stream_id
            if pre is None and self.sent:  # moved: the new node continues after the tokens sent
                call = d.stub.Generate(self._resumed(rid, stream))
            elif pre is None:
                self.tr.prefill = "local"
                call = d.stub.Generate(
                    pb.DecodeRequest(
                        request_id=rid, prompt_token_ids=ids, sampling=sp, images=self.images, token_stream=stream
                    )
                )
            else:
                f = pre.first
                self.tr.prefill, self.tr.reserve_s = pre.p.node_id, pre.reserve_s
                # the first token goes to the client at once, while the push runs
                yield self._relay(_first_message(f), pre, first=True)
                if f.finish_reason:  # the first token ended it: nothing was pushed
                    settled = True
                    self.svc.prefill.release_later(d, pre.rid, "finished at the first token")
                    return
                # D waits for every rank's state, then decodes
                call = d.stub.Generate(
                    pb.DecodeRequest(
                        request_id=pre.rid,
                        prompt_token_ids=ids,
                        sampling=sp,
                        reserved=True,
                        first_token_id=f.first_token_id,
                        draft_token_ids=f.draft_token_ids,
                        token_stream=stream,
                    )
                )
            first = pre is None and not self.sent
            watch = NodeWatch(lambda: d.alive, call.cancel, self.svc.cfg.heartbeat_interval_s)
            end = ""
            async for m in merged(call, route):
                settled = True  # D activated the reservation (or failed and released it)
                if m.finish_reason:
                    self.node_ended = m.node_ended  # the node's reports count this end from then on
                    end = m.finish_reason
                if pre is not None and m.finish_reason:
                    await pre.wait(5.0)  # the transfer figures, complete on the last message
                self._own_given_back(d)  # its first token: no longer queued there
                yield self._relay(m, pre, first=first)
                first = False
            settled = True
            if end in ("stop", "length"):  # D ended it (not a stop string here, nor a cancel)
                self.svc.remember_end(d, self.ids + self.sent, self.request, self.images)
        except DecodeFailed as df:
            await self._decode_failed(df.err, d, None)
        except grpc.RpcError as e:
            await self._decode_failed(e, d, pre, lost=watch is not None and watch.lost)
        except asyncio.CancelledError:  # the watch cancelled D's call (the request's task was not)
            task = asyncio.current_task()
            if watch is None or not watch.lost or (task is not None and task.cancelling()):
                raise
            await self._decode_failed(NodeLost(d.node_id), d, pre, lost=True)
        finally:
            if route is not None:
                route.close()
            if watch is not None:
                watch.stop()
            if call is not None:
                call.cancel()  # no-op when it completed; stops the node's work otherwise
            if pre is not None:
                if not settled:  # ended between the prefill and decode: free it now
                    self.svc.prefill.release_later(d, pre.rid, "the request ended before decode began")
                if not pre.done.is_set():
                    pre.call.cancel()  # the request is over: the prefill node aborts what is left

    def _resumed(self, rid: str, stream: str) -> pb.DecodeRequest:
        """The request moved to a new node: the same prompt and sampling, the tokens sent as its
        output (prompt logprobs were sent already)."""
        sp = pb.SamplingParams()
        sp.CopyFrom(self.request.sampling)
        sp.ClearField("prompt_logprobs")
        return pb.DecodeRequest(
            request_id=rid,
            prompt_token_ids=self.ids,
            sampling=sp,
            resume_token_ids=self.sent,
            images=self.images,
            token_stream=stream,
        )

    async def _decode_failed(self, e: grpc.RpcError, d: NodeEntry, pre: Push | None, lost: bool = False) -> None:
        """D refused or failed the request: raise _Retry (place it elsewhere), Moved (mid-stream:
        place it elsewhere with the tokens sent) or Abort. lost: the heartbeats declared D dead."""
        if e.code() == grpc.StatusCode.UNAVAILABLE and not lost and not is_draining(e):
            self.svc.registry.mark_unreachable(d, e.details() or "UNAVAILABLE")
        if e.code() == grpc.StatusCode.ALREADY_EXISTS and self.renames < MAX_RENAMES:
            self._renamed(d)
        if self.sent:
            if gave_memory_up(e):  # D may take it again: placed with its images, it can recompute there
                self.tried.discard(d.node_id)
            self.migration.move(e, d.node_id, len(self.sent), lost)  # raises unless not D's failure
        code = grpc.StatusCode.UNAVAILABLE if lost else e.code()
        if not self.tr.n and is_draining(e):  # D drains (before any token): place it on another node
            self.svc.registry.mark_draining(d)
            log.info("request %s: decode node %s is draining, placing it elsewhere", self.tr.request_id, d.node_id)
            raise _Retry
        if pre is not None and code == grpc.StatusCode.ABORTED and await pre.wait(5.0) and pre.error is not None:
            pe = pre.error  # D gave up because the push failed
            if pe.code() == grpc.StatusCode.UNAVAILABLE and self.sent:
                # the prefill node was lost mid-push, after the first token went out; D is not at
                # fault: place the request again (D too) to compute prompt + the tokens sent itself
                self.tried.discard(d.node_id)
                self.migration.move(pe, pre.p.node_id, len(self.sent), False)
            raise Abort(pe.code(), f"pushing the state from {pre.p.node_id} failed: {pe.details() or pe.code().name}")
        others = [n for n in self.svc.registry.routable(pb.NODE_KIND_DECODE) if n not in self.tried]
        if code == grpc.StatusCode.UNAVAILABLE and self.tr.n == 0 and len(self.tried) < 2 and others:
            log.warning("request %s: decode node %s unavailable, retrying elsewhere", self.tr.request_id, d.node_id)
            raise _Retry
        if code == grpc.StatusCode.UNAVAILABLE and self.tr.n == 0 and not others:
            # the last decode node stopped answering (crashed, killed): its connection error is in
            # the log (registry.mark_unreachable); the client learns what is missing
            raise Abort(code, f"{NO_DECODE} ({d.node_id} stopped answering)")
        raise Abort(code, e.details() or code.name)

    def _renamed(self, d: NodeEntry) -> None:
        """D holds the request's id still: the copy of a router that went away, whose stream the SDK
        resumed here under the same id, its reservation or its cancel not settled yet (or another
        router's request under that id). Place it again at once, under an id of its own on the
        nodes; the client keeps its id (docs/router.md, "Request ids on the nodes")."""
        self.renames += 1
        self.node_rid = f"{self.tr.request_id}~r{self.renames}"
        self.tried.discard(d.node_id)  # D may take it again
        log.info("request %s: %s holds its id still; placed again as %s", self.tr.request_id, d.node_id, self.node_rid)
        raise _Retry

    def _text(self, c: Chunk, ids: list[int], finish: str) -> None:
        """c.text (and, for a stop string's cut, each token's share in c.token_text) of the node's
        new tokens. A node's finish "stop" is an EOS or a stop_token_ids entry, the last token (stop
        strings are matched after this, router/stops.py): as vLLM's detokenizer, its id stays in the
        output and its text is left out unless include_stop_str_in_output."""
        assert self.detok is not None
        sp, final = self.request.sampling, bool(finish)
        hidden = finish == "stop" and bool(ids) and not sp.include_stop_str_in_output
        shown = ids[:-1] if hidden else ids
        if len(ids) > 1 and sp.stop:  # per token: where a stop string ends
            pieces = [self.detok.push([t]) for t in shown] + ([""] if hidden else [])
            if final:  # a character the last shown token left incomplete comes out whole or not at all
                pieces[len(shown) - 1] += self.detok.push([], final=True)
            c.token_text, c.text = pieces, "".join(pieces)
        else:
            c.text = self.detok.push(shown, final=final)

    def _relay(self, m: pb.GenerateResponse, pre: Push | None, first: bool, prefill_node: str = "") -> Chunk:
        """The node's message as a Chunk; prefill_node: the node that computed a request alone."""
        tr, now = self.tr, time.monotonic()
        if m.token_ids:
            if tr.first is None:
                self.svc.vllm.first_token(tr, now)
            elif tr.last is not None:
                self.svc.vllm.next_output(now - tr.last)
            tr.first = tr.first or now
            tr.last = now
            tr.n += len(m.token_ids)
            self.sent += m.token_ids
            self.migration.resumed()
        c = Chunk(
            token_ids=list(m.token_ids),
            finish_reason=m.finish_reason,
            logprobs=m.logprobs,
            prompt_logprobs=m.prompt_logprobs,
            request_id=tr.request_id,
        )
        if self.detok is not None and (m.token_ids or m.finish_reason):
            self._text(c, list(m.token_ids), m.finish_reason)
        if first:
            c.first, c.prompt_tokens, c.prompt_token_ids = True, tr.prompt_len, self.ids
            c.decode_node = "" if tr.decode == "-" else tr.decode  # none: computed on a prefill node alone
            c.prefill_node = prefill_node if pre is None else pre.p.node_id
            c.cached_tokens = m.cached_tokens if pre is None else pre.first.cached_tokens
        t, node = c.timings, m.timings
        t.queue_s = tr.queue_s + node.queue_s
        t.prefill_s, t.transfer_s, t.transfer_bytes = node.prefill_s, node.transfer_s, node.transfer_bytes
        if tr.first is not None:
            t.ttft_s = tr.first - tr.received
        if m.finish_reason:
            t.e2e_s = now - tr.received
            if tr.n > 1:
                t.tpot_s = (tr.last - tr.first) / (tr.n - 1)
        push = pre or self.push
        if push is not None:  # the transfer figures, complete on the last message
            pt = push.timings()
            t.prefill_s, t.transfer_s, t.transfer_bytes = pt.prefill_s, pt.transfer_s, pt.transfer_bytes
        if m.finish_reason or t.transfer_bytes:  # known once pushed: a request cancelled later has them too
            tr.transfer_bytes, tr.transfer_s = t.transfer_bytes, t.transfer_s
        if m.finish_reason:
            tr.finish = m.finish_reason
        return c
