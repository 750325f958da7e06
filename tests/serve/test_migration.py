"""Mid-stream migration (router/migrate.py): a cluster of 1 prefill + 2 decode nodes, one decode
node SIGKILLed while long streams are under way on both. Every stream completes with no error, no
duplicate and no gap: greedy ones are transformers' tokens (checked teacher-forced), seeded and
constrained ones the offline engine's, a stop string and max_tokens hold across the move; the
surviving nodes' pages and slots come back; the router counts the migrations. A router killed
mid-stream: the SDK's Generate and Chat streams go on through the next router."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Up, decode_stats, log_url, node_info, node_pid, scrape, wait_for

LONG = 160  # tokens per stream: long enough to be under way when the node dies
FAULTED = 400  # tokens per stream in the tests that fault a node after every stream's first chunk
SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 24,
    "maxItems": 24,
}


def _offline(ckpt, prompt, **kw):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    with LLM(ckpt, dtype="float32") as llm:
        return llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**kw))[0]


@pytest.fixture(scope="module")
def up(ckpt):
    u = Up("--model", ckpt, "--dtype", "float32", "--decode", "2", "--prefill", "1", "--metrics-port", "0")
    yield u
    rc = u.stop()
    assert rc == 0, u.output()


def test_streams_continue_on_the_other_decode_node(ckpt, up):
    from client import Client
    from engine.tokenizer import Tokenizer

    ps = hc.prompts(lens=(40, 70, 90, 120, 33, 57, 80, 100), seed=21)
    greedy = dict(max_tokens=LONG, temperature=0.0, ignore_eos=True)
    seeded = dict(max_tokens=LONG, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    tok = Tokenizer(ckpt)
    # a stop string late in prompt 0's greedy output: the text ends before its first match
    ref0 = hc.hf_greedy(ckpt, ps[0], LONG)
    text0 = tok.decode(ref0)
    stop = tok.decode(ref0[120:123])
    # the greedy streams run four times longer: whatever the machine's speed, some are still being
    # generated on the killed node (the short ones can be all sent before the kill lands)
    cases = [("greedy", ps[i], dict(greedy, max_tokens=4 * LONG)) for i in range(4)]
    cases += [("seeded", ps[i], dict(seeded, seed=7 + i)) for i in range(4, 7)]
    cases += [("stop", ps[0], dict(greedy, stop=[stop]))]
    cases += [
        ("json", ps[7], dict(max_tokens=400, temperature=0.0, constraint={"kind": "json_schema", "value": SCHEMA}))
    ]
    d0, d1 = node_info(up.address, "decode-0"), node_info(up.address, "decode-1")
    survivors = {"decode-0": d0, "decode-1": d1}
    initial = {n: decode_stats(i.address).capacity for n, i in survivors.items()}
    results: list[dict] = [{} for _ in cases]
    under_way = [threading.Event() for _ in cases]

    with Client(up.address, timeout=300) as c:
        c.wait_ready(timeout=60)

        def one(i: int) -> None:
            kind, p, kw = cases[i]
            r = results[i]
            r.update(tokens=[], text="", node="", finish=None)
            try:
                with c.stream(prompt_token_ids=p, **kw) as s:
                    for ch in s:
                        r["tokens"] += ch.token_ids
                        r["text"] += ch.text
                        r["node"] = ch.decode_node or r["node"]
                        if len(r["tokens"]) >= 4:
                            under_way[i].set()
                        if ch.finish_reason:
                            r["finish"] = ch.finish_reason
            except Exception as e:  # reported below with the case
                r["error"] = repr(e)
            finally:
                under_way[i].set()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
        for t in threads:
            t.start()
        for e in under_way:
            assert e.wait(120)
        on = {n: sum(1 for r in results if r["node"] == n and r["finish"] is None) for n in survivors}
        victim = max(on, key=lambda n: on[n])
        assert on[victim] > 0, on
        os.kill(node_pid(up, victim), signal.SIGKILL)
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads)
    moved = [i for i, r in enumerate(results) if r["node"] == victim]
    assert moved and not [r for r in results if "error" in r], results

    for (kind, p, kw), r in zip(cases, results):
        toks = r["tokens"]
        if kind == "greedy":
            assert len(toks) == kw["max_tokens"] and r["finish"] == "length"
            assert hc.hf_greedy_violations(ckpt, p, toks) == [], (kind, r["node"])
        elif kind == "seeded":
            want = _offline(ckpt, p, **{k: v for k, v in kw.items()})
            assert toks == want.output_token_ids, (kind, r["node"])
        elif kind == "stop":
            assert r["finish"] == "stop" and r["text"] == text0[: text0.index(stop)], r["node"]
        else:
            value = json.loads(r["text"])
            assert len(value) == 24 and all(isinstance(v, int) and 0 <= v <= 9 for v in value), r["text"]
            want = _offline(ckpt, p, max_tokens=400, temperature=0.0, constraint=_engine_constraint(SCHEMA))
            assert toks == want.output_token_ids

    alive = {n: i for n, i in survivors.items() if n != victim}
    for n, i in alive.items():
        wait_for(lambda i=i, n=n: decode_stats(i.address).capacity == initial[n], 30, f"{n}'s memory back")
    m = scrape(log_url(up, r"router metrics at (http://\S+)"))
    moves = sum(v for k, v in m.items() if k[0] == "pdserve_router_migrations_total")
    assert 1 <= moves <= len(moved), m
    assert "moved from " + victim in up.output()


def _engine_constraint(schema):
    from engine.structured.spec import Constraint

    return Constraint("json_schema", json.dumps(schema))


def _under_fault(u: Up, ps, n: int, fault) -> tuple[list[list[int]], str]:
    """Greedy streams of n tokens after each prompt; once each has its first chunk, fault(victim,
    its pid) on the decode node holding most of them. Returns every stream's tokens and the victim.
    The pids are found before the streams start: a lookup after their first chunks took long
    enough on a loaded machine for the streams to end before the fault."""
    from client import Client

    assert u.address is not None
    with Client(u.address, timeout=120) as c:
        c.wait_ready(timeout=60)
        pids = {d.node.node_id: node_pid(u, d.node.node_id) for d in _nodes(u.address)}
        its = [iter(c.stream(prompt_token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True)) for p in ps]
        got = [next(it) for it in its]
        nodes_of = [g.decode_node for g in got]
        victim = max(set(nodes_of), key=nodes_of.count)
        fault(victim, pids[victim])
        toks = [list(g.token_ids) for g in got]
        for i, it in enumerate(its):
            for ch in it:
                toks[i] += ch.token_ids
    return toks, victim


def test_a_hung_decode_node_is_declared_dead_and_its_streams_move(ckpt):
    """SIGSTOP, not SIGKILL: the streams stall with no error until the heartbeats declare the node
    dead; then they move and complete with transformers' tokens."""
    ps = hc.prompts(lens=(30, 60, 45, 75), seed=23)
    u = Up("--model", ckpt, "--dtype", "float32", "--decode", "2", "--prefill", "1")
    stopped: list[int] = []

    def hang(victim: str, pid: int) -> None:
        stopped.append(pid)
        os.kill(pid, signal.SIGSTOP)

    try:
        n = FAULTED  # the node stops after every stream's first chunk (with 200 a loaded run's streams had ended)
        toks, _ = _under_fault(u, ps, n, hang)
        for p, t in zip(ps, toks):
            assert len(t) == n and hc.hf_greedy_violations(ckpt, p, t) == []
        assert "(node_dead@" in u.output()
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGKILL)
        u.stop()


def test_a_hung_prefill_node_is_declared_dead_and_its_prompt_goes_on(ckpt):
    """A prefill node SIGSTOPped (hung, its process alive) with a prompt sent to it: once the
    heartbeats declare it dead the router cancels its Prefill call and the decode node computes the
    prompt itself, so the request ends with transformers' tokens within seconds, not when the
    call's deadline (--prefill-timeout, 120 s, and more) ends it with an error. Back (SIGCONT),
    the node prefills again, and the decode node's memory is all back."""
    import time

    from client import Client

    p, fresh = hc.prompts(lens=(200, 150), seed=43)
    want = hc.hf_greedy(ckpt, p, 16)
    u = Up("--model", ckpt, "--dtype", "float32", "--decode", "1", "--prefill", "1")
    pid = node_pid(u, "prefill-0")
    stopped = False
    try:
        d = node_info(u.address, "decode-0")
        initial = decode_stats(d.address).capacity
        kw = dict(max_tokens=16, temperature=0.0, ignore_eos=True, admission_timeout_s=0)
        with Client(u.address, timeout=40) as c:
            c.wait_ready(60)
            os.kill(pid, signal.SIGSTOP)
            stopped, t0 = True, time.monotonic()
            r = c.generate(prompt_token_ids=p, **kw)
            took = time.monotonic() - t0
            assert r.token_ids == want
            assert "prefill node prefill-0 was declared dead" in u.output()
            assert took < 25, took  # the heartbeats' 3 s, then the prompt on the decode node
            os.kill(pid, signal.SIGCONT)
            stopped = False
            u.find(r"node (prefill-0) .*is back")
            r = c.generate(prompt_token_ids=fresh, **kw)
            assert r.token_ids == hc.hf_greedy(ckpt, fresh, 16) and r.prefill_node == "prefill-0"
        wait_for(lambda: decode_stats(d.address).capacity == initial, 30, "the decode node's memory back")
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        u.stop()


def test_the_only_decode_node_killed_and_started_again_takes_its_streams_back(ckpt):
    """One decode node, SIGKILLed mid-stream and started again under its id (as a StatefulSet's
    pod comes back): the stream waits in admission and goes on on the new incarnation, ending with
    transformers' tokens; the failed incarnation is excluded, not its id."""
    from client import Client
    from tests.helpers.serve_harness import Proc, flags

    p = hc.prompts(lens=(40,), seed=53)[0]
    u = Up("--model", ckpt, "--dtype", "float32", "--decode", "1", "--prefill", "1")
    again = None
    try:
        pid = node_pid(u, "decode-0")
        with Client(u.address, timeout=60) as c:
            c.wait_ready(60)
            it = iter(c.stream(prompt_token_ids=p, max_tokens=LONG, temperature=0.0, ignore_eos=True))
            toks = list(next(it).token_ids)
            os.kill(pid, signal.SIGKILL)
            node = flags(dtype="float32", router=u.address, node_id="decode-0")
            again = Proc("decode", "--model", ckpt, *node, ready=r"decode node \S+ listening on (\S+)")
            for ch in it:
                toks += ch.token_ids
        assert len(toks) == LONG and hc.hf_greedy_violations(ckpt, p, toks) == []
        assert "moved from decode-0(" in u.find(r"(pdserve.router: request .*moved from .*)")
    finally:
        if again is not None:
            again.stop()
        u.stop()


def test_the_last_decode_node_killed_ends_the_stream_with_a_clear_error(ckpt):
    """No decode node left to move to: the stream ends UNAVAILABLE once its admission time is
    out (2 s here), no hang, and the message says it had streamed and moved (docs/router.md)."""
    import time

    from client import Client, PdserveError

    p = hc.prompts(lens=(40,), seed=59)[0]
    u = Up("--model", ckpt, "--dtype", "float32", "--decode", "1", "--prefill", "0", "--admission-timeout", "2")
    try:
        pid = node_pid(u, "decode-0")
        with Client(u.address, timeout=60) as c:
            c.wait_ready(60)
            it = iter(c.stream(prompt_token_ids=p, max_tokens=LONG, temperature=0.0, ignore_eos=True))
            n = len(next(it).token_ids)
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(PdserveError) as e:
                for ch in it:
                    n += len(ch.token_ids)
        assert time.monotonic() - t0 < 20 and e.value.code.name == "UNAVAILABLE"
        msg = str(e.value)
        assert "no decode node is ready" in msg and f"after {n} tokens; moved 1 time(s): decode-0(" in msg
    finally:
        u.stop()


@pytest.mark.slow  # the acceptance test (test_migration_acceptance.py) kills a TP 2 decode node too
def test_a_tp2_decode_node_killed_mid_stream(ckpt):
    """Decode nodes at TP 2 (a node and its worker process): one SIGKILLed, its streams move to
    the other and complete with transformers' tokens."""
    ps = hc.prompts(lens=(30, 60, 45, 75), seed=37)
    u = Up("--model", ckpt, "--dtype", "float32", "--decode", "2", "--decode-tp", "2", "--prefill", "1")
    try:
        toks, victim = _under_fault(u, ps, FAULTED, lambda v, pid: os.kill(pid, signal.SIGKILL))
        for p, t in zip(ps, toks):
            assert len(t) == FAULTED and hc.hf_greedy_violations(ckpt, p, t) == []
        # the stream's error or the heartbeats' verdict, whichever the router saw first; every line
        # of the log (output() keeps the last 200, and the dead ranks' peers log long tracebacks)
        out = "".join(u.lines)
        assert f"moved from {victim}(unavailable@" in out or f"moved from {victim}(node_dead@" in out
    finally:
        u.stop()


def test_drain_hands_long_streams_off(ckpt):
    """--drain-handoff: a decode node SIGTERMed with long streams exits within seconds (not when
    its longest stream would end); its streams move and complete with transformers' tokens."""
    import time

    # 1,200 tokens: about 5 s at CI's 4 ms a token, under way when the drain hands off after 0.1 s
    # (400 had all ended on CI before the SIGTERM, the four prompts' prefills taking their turns)
    n = 1200
    ps = hc.prompts(lens=(30, 60, 45, 75), seed=29)
    u = Up("--model", ckpt, "--dtype", "float32", "--decode", "2", "--prefill", "1", "--drain-handoff", "0.1",
           "--drain-timeout", "120")  # fmt: skip
    exited: list[float] = []

    def term(victim: str, pid: int) -> None:
        os.kill(pid, signal.SIGTERM)
        t0 = time.monotonic()
        wait_for(lambda: f"{victim} exited with status 0" in u.output(), 30, f"{victim} to exit")
        exited.append(time.monotonic() - t0)

    try:
        toks, _ = _under_fault(u, ps, n, term)
        assert exited[0] < 10, exited
        for p, t in zip(ps, toks):
            assert len(t) == n and hc.hf_greedy_violations(ckpt, p, t) == []
        assert "(draining@" in u.output()
    finally:
        rc = u.stop()
    assert rc == 0, u.output()


def test_sdk_resumes_on_the_next_router(ckpt):
    """Two routers over the same pools; the one a stream goes through is SIGKILLed mid-stream: the
    SDK resumes on the other with the tokens it has (resume_token_ids), and the stream completes
    with transformers' tokens, no duplicate and no gap; the decode node's memory comes back."""
    from client import Client
    from tests.helpers.serve_harness import Proc, two_routers

    p = hc.prompts(lens=(50,), seed=31)[0]
    procs: list[Proc] = []
    try:
        ra, rb = two_routers(ckpt, procs)
        d = node_info(rb.address, "decode-0")
        initial = decode_stats(d.address).capacity
        with Client([ra.address, rb.address], timeout=120) as c:
            c.wait_ready(60)
            toks: list[int] = []
            with c.stream(prompt_token_ids=p, max_tokens=LONG, temperature=0.0, ignore_eos=True) as s:
                for ch in s:
                    toks += ch.token_ids
                    if len(toks) >= 8 and ra.proc.poll() is None:
                        ra.proc.send_signal(signal.SIGKILL)
            assert c.addr == rb.address
        assert len(toks) == LONG and hc.hf_greedy_violations(ckpt, p, toks) == []
        resumed = int(rb.find(r"prompt 50, .* (\d+) tokens, length"))  # what the second router streamed
        assert 0 < resumed <= LONG - 8, resumed
        wait_for(lambda: decode_stats(d.address).capacity == initial, 30, "the decode node's memory back")
    finally:
        for pr in reversed(procs):
            pr.stop()


def test_sdk_chat_resumes_on_the_next_router(ckpt):
    """Chat over gRPC (Client.chat_stream), two seeded sampled choices, through two routers over
    the same pools; the router streaming it is SIGKILLed mid-answer: the SDK resumes on the other
    with each choice's tokens (ChatRequest.resume), and the answer (each choice's text, its finish
    and the usage) equals the same request answered by one router with no fault."""
    import re

    from client import Client
    from client.chat import ChatResult
    from tests.helpers.serve_harness import Proc, two_routers

    msgs = [{"role": "user", "content": "Tell me a long story."}]
    kw = dict(
        max_tokens=FAULTED, temperature=1.0, top_p=0.9, seed=7, n=2, ignore_eos=True
    )  # long: mid-stream on a slow reader too
    kw["chat_template_kwargs"] = {"enable_thinking": False}
    done = re.compile(r"prompt \d+, .* (\d+) tokens, length")
    procs: list[Proc] = []
    try:
        ra, rb = two_routers(ckpt, procs)
        with Client(rb.address, timeout=120) as c:
            c.wait_ready(60)
            want = c.chat(msgs, **kw)
        ended = lambda: [int(m.group(1)) for ln in list(rb.lines) if (m := done.search(ln))]  # noqa: E731
        wait_for(lambda: len(ended()) == 2, 20, "the unfaulted choices' log lines")
        got, chunks = ChatResult(), [0, 0]
        with Client([ra.address, rb.address], timeout=120) as c:
            c.wait_ready(60)
            for ch in c.chat_stream(msgs, **kw):
                got.add(ch)
                if "index" in ch:
                    chunks[ch["index"]] += 1
                if min(chunks) >= 8 and ra.proc.poll() is None:
                    ra.proc.send_signal(signal.SIGKILL)
            assert c.addr == rb.address
        assert ra.proc.poll() is not None
        assert [ch.message for ch in got.choices] == [ch.message for ch in want.choices]
        assert got.choices[0].message["content"] != got.choices[1].message["content"]  # two seeds
        assert [ch.finish_reason for ch in got.choices] == ["length", "length"]
        # cached_tokens is what the prefix cache held when each prefill ran: the resumed prefills
        # and the unfaulted one's two choices race for it, so it is bounded, not compared
        cached = lambda u: u.pop("prompt_tokens_details")["cached_tokens"]  # noqa: E731
        for u in (got.usage, want.usage):
            assert 0 <= cached(u) <= u["prompt_tokens"]
        assert got.usage == want.usage
        wait_for(lambda: len(ended()) == 4, 20, "the resumed choices' log lines")
        resumed = ended()[2:]
        assert all(0 < k <= FAULTED - 8 for k in resumed), resumed  # each went on from its tokens
    finally:
        for pr in reversed(procs):
            pr.stop()


def test_openai_n2_stream_moves_and_counts_usage_once(ckpt):
    """OpenAI completions, n = 2, streamed with usage: the decode node holding a choice is SIGKILLed
    mid-stream; both choices complete with transformers' text and usage counts every token once."""
    import openai

    from engine.tokenizer import Tokenizer

    p, n = hc.prompts(lens=(45,), seed=41)[0], 600  # long enough that a lagging client still kills mid-stream
    want = Tokenizer(ckpt).decode(hc.hf_greedy(ckpt, p, n))
    u = Up("--model", ckpt, "--dtype", "float32", "--decode", "2", "--prefill", "1", "--http-port", "0")
    try:
        url = log_url(u, r"OpenAI-compatible HTTP on (http://\S+/v1)")
        # resolved before the stream: the kill lands within a few milliseconds of both choices'
        # first text, not after the imports and process walks the first lookups take
        decode = {d.node.node_id: d.node.address for d in _nodes(u.address)}
        pids = {n: node_pid(u, n) for n in decode}
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as oc:
            model = oc.models.list().data[0].id
            texts, usage, killed = ["", ""], None, False
            stream = oc.completions.create(
                model=model, prompt=p, max_tokens=n, temperature=0.0, n=2, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for ev in stream:
                for ch in ev.choices:
                    texts[ch.index] += ch.text
                usage = ev.usage or usage
                if not killed and all(texts):
                    os.kill(pids[_busiest(decode)], signal.SIGKILL)
                    killed = True
        assert killed and texts == [want, want]
        assert usage is not None and usage.completion_tokens == 2 * n and usage.prompt_tokens == len(p)
        # the router logs the request once it has ended, after the client saw its last chunk
        assert u.find(r"(moved from decode-\d)", timeout=45)
    except AssertionError:
        print(u.output())
        raise
    finally:
        u.stop()


def _busiest(decode: dict[str, str]) -> str:
    """The decode node (of {node id: address}) running the most streams, once a node's reported
    stats show any running (a node's stats are a snapshot from its last engine pass and can trail
    a stream's start)."""

    def busy() -> dict[str, int] | None:
        b = {n: decode_stats(a).capacity.running for n, a in decode.items()}
        return b if any(b.values()) else None

    b = wait_for(busy, 20, "a decode node reporting a running stream")
    return max(b, key=lambda k: b[k])


def _nodes(address: str):
    from tests.helpers.serve_harness import nodes

    return [n for n in nodes(address) if n.node.node_id.startswith("decode-")]
