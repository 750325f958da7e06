"""Admission decided at arrival through `pdserve up` (1 prefill + 1 decode node on loopback, the
tiny model): a burst larger than what can start within the 1 s budget has its excess refused
RESOURCE_EXHAUSTED at once (well under 0.5 s, with the estimated wait as Retry-After) while the
admitted ones complete with transformers' greedy tokens; a request that allows waiting (its
field, or the HTTP header) is served; interactive requests sent after a batch burst start before
the queued batch ones; two API keys in one class take turns."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Up, flags, log_url, node_pid, scrape, wait_for

PROMPT_LEN, NEW = 300, 4
KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"
STEP = ("--max-num-batched-tokens", "64")  # a slow prefill: a burst queues for seconds


@pytest.fixture(scope="module")
def cluster(ckpt, tmp_path_factory):
    keys = tmp_path_factory.mktemp("adm") / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    up = Up(
        "--model",
        ckpt,
        *flags(dtype="float32", prefill=1, decode=1, http_port=0, metrics_port=0, admission_timeout=1.0),
        *flags(api_key_file=keys, prefill_window_tokens=2 * PROMPT_LEN + 20),
        *flags(dead_after=30),  # the prefill node is frozen for a moment in the ordering test
        *STEP,
    )
    try:
        yield up
    finally:
        assert up.stop() == 0


@pytest.fixture(scope="module")
def burst(ckpt):
    """Distinct prompts (none finds another's prefix in the prefill node's cache) and
    transformers' greedy tokens after each."""
    ps = hc.prompts(lens=[PROMPT_LEN + i % 7 for i in range(56)], seed=31)
    return ps, _Refs(ckpt, ps)


class _Refs(dict):
    """transformers' tokens after ps[i], computed when first read (a refused request needs none)."""

    def __init__(self, ckpt, ps):
        super().__init__()
        self.ckpt, self.ps = ckpt, ps

    def __missing__(self, i: int) -> list[int]:
        self[i] = hc.hf_greedy(self.ckpt, self.ps[i], NEW)
        return self[i]


def _timed(c, p, **kw):
    """(result or PdserveError, seconds to the answer, monotonic time of the first token)."""
    from client import PdserveError

    t0 = time.monotonic()
    try:
        s = c.stream(prompt_token_ids=p, max_tokens=NEW, temperature=0.0, ignore_eos=True, **kw)
        toks, first = [], None
        for ch in s:
            first = first or time.monotonic()
            toks += ch.token_ids
        return toks, time.monotonic() - t0, first
    except PdserveError as e:
        return e, time.monotonic() - t0, None


def _warm(c, ps, want):
    """Three requests: the prefill node's rate is measured from these."""
    for p, w in zip(ps, want, strict=True):
        r = c.generate(prompt_token_ids=p, max_tokens=NEW, temperature=0.0, ignore_eos=True)
        assert r.token_ids == w and r.prefill_node == "prefill-0"


@pytest.mark.serial  # a refusal within 0.5 s of arrival: run alone, not beside another test worker
def test_burst_refused_at_arrival_admitted_exact(cluster, burst):
    from client import Client

    ps, want = burst
    base = log_url(cluster, r"OpenAI-compatible HTTP on (http://\S+/v1)")
    router_metrics = log_url(cluster, r"router metrics at (http://\S+/metrics)")
    n = 30
    with Client(cluster.address, timeout=300, api_key=KEY_A) as c:
        c.wait_ready(timeout=60)
        _warm(c, ps[n + 2 : n + 5], [want[k] for k in range(n + 2, n + 5)])
        with ThreadPoolExecutor(n + 1) as ex:
            futs = [ex.submit(_timed, c, ps[i]) for i in range(n)]
            patient = ex.submit(_timed, c, ps[n], admission_timeout_s=0.0)  # waits as long as it takes
            # over HTTP: the header's budget; too short, refused with the estimate as Retry-After
            body = json.dumps({"model": "ckpt", "prompt": ps[n + 1], "max_tokens": NEW, "temperature": 0.0}).encode()
            hdr = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY_B}"}
            short = urllib.request.Request(base + "/completions", body, {**hdr, "x-pdserve-admission-timeout": "0.01"})
            with pytest.raises(urllib.error.HTTPError) as ei:
                urllib.request.urlopen(short, timeout=60)
            assert ei.value.code == 429 and int(ei.value.headers["Retry-After"]) >= 1
            assert "past its admission budget of 0.01 s" in json.loads(ei.value.read())["error"]["message"]
            wait = scrape(router_metrics)[
                ("pdserve_router_estimated_wait_seconds", (("class", "interactive"), ("pool", "prefill")))
            ]
            assert wait > 0.01  # what refused it, while the burst is in flight
            ok = urllib.request.Request(base + "/completions", body, {**hdr, "x-pdserve-admission-timeout": "0"})
            with urllib.request.urlopen(ok, timeout=300) as r:
                assert json.loads(r.read())["usage"]["completion_tokens"] == NEW
            bad = urllib.request.Request(base + "/completions", body, {**hdr, "x-pdserve-priority": "urgent"})
            with pytest.raises(urllib.error.HTTPError) as ei:
                urllib.request.urlopen(bad, timeout=60)
            assert ei.value.code == 400 and "x-pdserve-priority" in ei.value.read().decode()
            outs = [f.result(timeout=300) for f in futs]
            toks, _, _ = patient.result(timeout=300)
    assert toks == want[n]
    done = [(i, r) for i, (r, _, _) in enumerate(outs) if isinstance(r, list)]
    refused = [(i, r, s) for i, (r, s, _) in enumerate(outs) if not isinstance(r, list)]
    assert done and refused, outs
    for i, r in done:
        assert r == want[i], i
    for i, e, s in refused:
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "past its admission budget" in e.message, e
        assert s < 0.5 and e.retry_after_s is not None and e.retry_after_s > 1.0, (i, s, e.retry_after_s)
    m = scrape(router_metrics)
    assert m[("pdserve_router_admission_refused_total", (("class", "interactive"), ("reason", "estimate")))] >= len(
        refused
    )

    # the burst over, no estimate stands: every class and pool reads 0 again
    def waits() -> list[float]:
        return [v for (k, _), v in scrape(router_metrics).items() if k == "pdserve_router_estimated_wait_seconds"]

    wait_for(lambda: waits() == [0.0] * 4, 10, f"the estimated waits back at 0 (now {waits()})")


def test_interactive_before_batch_and_keys_take_turns(cluster, burst):
    from client import Client

    ps, want = burst
    with (
        Client(cluster.address, timeout=300, api_key=KEY_A) as a,
        Client(cluster.address, timeout=300, api_key=KEY_B) as b,
    ):
        a.wait_ready(timeout=60)
        _warm(a, ps[:3], [want[k] for k in range(3)])  # measured already by the other test, when it ran
        ps = ps[35:]  # not in the prefill node's prefix cache
        router_metrics = log_url(cluster, r"router metrics at (http://\S+/metrics)")

        def depth() -> float:
            return scrape(router_metrics)[("pdserve_router_queue_depth", ())]

        def active() -> float:
            return scrape(router_metrics)[("pdserve_router_active_requests", ())]

        def until(gauge, want: float, what: str) -> None:
            """wait_for, and on a timeout the gauges and the cluster's warnings (a rare CI timeout)."""
            try:
                wait_for(lambda: gauge() == want, 60, what)
            except AssertionError:
                warned = [ln for ln in cluster.output().splitlines() if "WARNING" in ln or "ERROR" in ln]
                raise AssertionError(f"{what}: depth {depth()}, active {active()}; {warned[-12:]}") from None

        def send(c, i: int, **kw):
            return ex.submit(_timed, c, ps[i], admission_timeout_s=0.0, **kw)

        # the prefill node frozen while the requests arrive: the window takes A's first two and
        # everything else queues, however fast the machine would have drained the burst
        victim = node_pid(cluster, "prefill-0")
        with ThreadPoolExecutor(24) as ex:
            os.kill(victim, signal.SIGSTOP)
            try:
                batch_a = [send(a, i, priority="batch") for i in range(14)]
                until(depth, 12, "key A's batch requests queued")
                batch_b = [send(b, 14 + i, priority="batch") for i in range(4)]
                until(depth, 16, "key B's batch requests queued")
                inter = [send(b, 18 + i) for i in range(3)]
                until(active, 21, "every request at the router")
            finally:
                os.kill(victim, signal.SIGCONT)
            ra, rb, ri = ([f.result(timeout=600) for f in fs] for fs in (batch_a, batch_b, inter))
    for i, (toks, _, _) in enumerate(ra + rb + ri):
        assert toks == want[35 + i], i
    first_a = sorted(f for _, _, f in ra)
    first_b = sorted(f for _, _, f in rb)
    first_i = [f for _, _, f in ri]
    # interactive ones, sent last, start before the batch ones still queued then (8 or more)
    assert max(first_i) < first_a[-4] and max(first_i) < first_b[-1], (first_i, first_a, first_b)
    # key B's 4, queued behind key A's 8 waiting, take turns with them: all start before A's last 3
    assert first_b[-1] < first_a[-3], (first_a, first_b)
