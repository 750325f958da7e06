"""vLLM's metric names, the router's per-node bookkeeping and the router's readiness, on a real
router, prefill node and decode node on loopback (in-process), scraped over HTTP and parsed with
prometheus_client's text parser:

- what a vLLM dashboard, autoscaler or gateway reads agrees with what the clients saw: requests
  by finished_reason, prompt and generated tokens equal the usage fields summed, one histogram
  sample per request, a refused request is not one (vLLM counts none either);
- every server labels its vllm:* series with the same model_name, the first --served-model-name
  (`pdserve up` passes it to the nodes), as vLLM's dashboards filter by one;
- a request in flight shows on the router (running, its decode node's in-flight request and
  blocks) and on the decode node, and every gauge returns to 0 once it ends;
- gRPC readiness of pdserve.v1.Generation (the Kubernetes readiness probe) follows HTTP /health:
  not ready with no decode node, ready once one registers, not ready when it dies or the router
  drains, while liveness (the overall status) stays SERVING."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import pb, rpc
from tests.helpers.serve_harness import scrape, wait_for

M = "tiny"  # --served-model-name: the model_name label
BLOCK = 16


@contextlib.contextmanager
def _nodes(port: int, ckpt, prefill: bool = True):
    from decode_node.config import DecodeNodeConfig
    from decode_node.server import serve as serve_decode
    from prefill_node.config import PrefillNodeConfig
    from prefill_node.server import serve as serve_prefill

    common: dict[str, Any] = dict(
        model=str(ckpt), dtype="float32", router=f"127.0.0.1:{port}", heartbeat_interval_s=0.2, served_model_name=(M,)
    )
    d, _ = serve_decode(
        "127.0.0.1:0", DecodeNodeConfig(**common, metrics_port=0, block_size=BLOCK, local_prefill_threshold=0)
    )
    p = (
        serve_prefill("127.0.0.1:0", PrefillNodeConfig(**common, metrics_port=0, block_size=BLOCK))[0]
        if prefill
        else None
    )
    try:
        yield d, p
    finally:
        for n in (p, d):
            if n is not None:
                n.stop(0)


@pytest.fixture(scope="module")
def cluster(ckpt):
    from router.server import RouterConfig, serve

    cfg = RouterConfig(model=str(ckpt), heartbeat_interval_s=0.2, http_port=0, metrics_port=0, served_model_name=(M,))
    r, port = serve("127.0.0.1:0", cfg)
    try:
        with _nodes(port, ckpt) as (d, p):
            wait_for(lambda: r.registry.live(pb.NODE_KIND_DECODE) and r.registry.live(pb.NODE_KIND_PREFILL), 60)
            urls = {
                "router": f"http://127.0.0.1:{r.metrics_port}/metrics",
                "decode": f"http://127.0.0.1:{d.metrics_port}/metrics",
                "prefill": f"http://127.0.0.1:{p.metrics_port}/metrics",
            }
            yield r, urls, f"127.0.0.1:{port}"
    finally:
        r.stop(0)


@pytest.fixture(scope="module")
def oai(cluster):
    import openai

    r, _, _ = cluster
    with openai.OpenAI(base_url=f"http://127.0.0.1:{r.http_port}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def _moved(before: dict, after: dict):
    def moved(name: str, **labels) -> float:
        key = (name, tuple(sorted({"model_name": M, **labels}.items())))
        assert key in after, f"{name}{labels} missing"
        return after[key] - before.get(key, 0.0)

    return moved


def test_vllm_series_count_what_the_clients_got(cluster, oai):
    import openai

    _, urls, _ = cluster
    before = scrape(urls["router"])
    usage = []  # (prompt tokens, completion tokens) as each client was told
    for i in range(3):
        x = oai.completions.create(
            model=M, prompt="Hello there " * (i + 1), max_tokens=4 + i, temperature=0, extra_body={"ignore_eos": True}
        )
        assert x.choices[0].finish_reason == "length"
        usage.append((x.usage.prompt_tokens, x.usage.completion_tokens))
    stream = oai.chat.completions.create(
        model=M,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage += [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in stream if c.usage]
    with pytest.raises(openai.BadRequestError):  # refused at the door: no request in vLLM's sense
        oai.completions.create(model=M, prompt=[10**6], max_tokens=2)
    after = scrape(urls["router"])
    moved, k = _moved(before, after), len(usage)
    assert k == 4
    assert moved("vllm:request_success_total", finished_reason="length") == k
    for reason in ("stop", "abort", "error"):
        assert moved("vllm:request_success_total", finished_reason=reason) == 0
    assert moved("vllm:prompt_tokens_total") == sum(u[0] for u in usage)
    assert moved("vllm:generation_tokens_total") == sum(u[1] for u in usage)
    assert moved("vllm:request_prompt_tokens_sum") == sum(u[0] for u in usage)
    assert moved("vllm:request_generation_tokens_sum") == sum(u[1] for u in usage)
    for h in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert moved(f"vllm:{h}_count") == k, h
    # one sample per output after a request's first: at most one per token after the first
    itl = moved("vllm:inter_token_latency_seconds_count")
    assert 0 < itl <= sum(u[1] - 1 for u in usage)
    assert moved("vllm:time_per_output_token_seconds_count") == itl
    for server in ("router", "decode", "prefill"):
        s = scrape(urls[server])
        for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert (f"vllm:{g}", (("model_name", M),)) in s, (server, g)


def _vllm_labels(s: dict) -> set[str]:
    """The model_name labels of a /metrics page's vllm:* series."""
    return {dict(labels).get("model_name", "") for name, labels in s if name.startswith("vllm:")}


def test_up_labels_every_server_with_the_first_served_name(ckpt):
    """vLLM's dashboards filter every panel by one model_name: `up --served-model-name` gives the
    router and both node kinds the same label, the first name (an alias is no label)."""
    from tests.helpers.serve_harness import Up, flags, log_url

    u = Up(
        "--model",
        str(ckpt),
        *flags(dtype="float32", decode=1, prefill=1, metrics_port=0),
        "--served-model-name",
        M,
        "--served-model-name",
        "alias",
    )
    try:
        for who in ("router", "decode node decode-0", "prefill node prefill-0"):
            s = scrape(log_url(u, rf"{who} metrics at (http://\S+/metrics)"))
            assert ("vllm:num_requests_running", (("model_name", M),)) in s, who
            assert _vllm_labels(s) == {M}, who
    finally:
        assert u.stop() == 0, u.output()


def test_a_request_in_flight_shows_then_every_gauge_returns_to_zero(cluster):
    from client import Client

    _, urls, addr = cluster
    prompt = list(range(5, 45))  # 40 tokens: 3 blocks of 16 with its next token
    before = scrape(urls["router"])
    with Client(addr, timeout=60) as c:
        s = c.stream(prompt_token_ids=prompt, max_tokens=4000, temperature=0.0, ignore_eos=True)
        it = iter(s)
        next(it)  # the first token is the prefill node's: the decode node may still hold a reservation
        next(it)  # a token the decode node sampled: it is in that node's running batch now
        mid = {k: scrape(u) for k, u in urls.items()}
        s.close()  # the client leaves: an abort
    rt, dn = mid["router"], mid["decode"]
    assert rt[("vllm:num_requests_running", (("model_name", M),))] == 1
    assert rt[("vllm:num_requests_waiting", (("model_name", M),))] == 0
    node = (("kind", "decode"), ("node", "decode-0"))
    assert rt[("pdserve_router_node_inflight_requests", node)] == 1
    assert rt[("pdserve_router_node_inflight_blocks", node)] == -(-(len(prompt) + 1) // BLOCK)
    assert rt[("pdserve_router_node_up", node)] == 1
    assert dn[("vllm:num_requests_running", (("model_name", M),))] == 1
    assert dn[("vllm:kv_cache_usage_perc", (("model_name", M),))] > 0

    def idle() -> bool:
        now = {k: scrape(u) for k, u in urls.items()}
        for v in now.values():
            for (name, _), x in v.items():
                if name in ("vllm:num_requests_running", "vllm:num_requests_waiting") and x != 0:
                    return False
                if name.startswith("pdserve_router_node_inflight") and x != 0:
                    return False
        return True

    wait_for(idle, 10, "every running / waiting / in-flight gauge back to 0")
    after = scrape(urls["router"])
    assert _moved(before, after)("vllm:request_success_total", finished_reason="abort") == 1


def _ready(addr: str, service: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _http_get(port: int, path: str = "/health") -> tuple[int, str]:
    """(HTTP status, the JSON body's status) of a GET."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())["status"]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["status"]


def _http_health(port: int) -> int:
    return _http_get(port)[0]


def test_readiness_needs_a_decode_node_and_liveness_stays(ckpt):
    """gRPC readiness, the HTTP port's /health and the plain-HTTP metrics port's /health (what the
    TLS overlay's httpGet probes ask) agree through no decode node / ready / draining; the metrics
    port's /live stays 200."""
    from router.server import RouterConfig, serve

    SERVING, NOT = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    cfg = RouterConfig(model=str(ckpt), heartbeat_interval_s=0.2, dead_after_s=0.8, http_port=0, metrics_port=0)
    r, port = serve("127.0.0.1:0", cfg)
    addr, gen = f"127.0.0.1:{port}", "pdserve.v1.Generation"

    def probes() -> tuple:
        return _http_get(r.metrics_port), _http_get(r.metrics_port, "/live")

    try:
        assert (_ready(addr, gen), _ready(addr, ""), _http_health(r.http_port)) == (NOT, SERVING, 503)
        assert probes() == ((503, "no_decode_node"), (200, "ok"))
        with _nodes(port, ckpt, prefill=False):
            wait_for(lambda: _ready(addr, gen) == SERVING, 30, "ready once a decode node registered")
            assert _http_health(r.http_port) == 200 and probes() == ((200, "ok"), (200, "ok"))
        wait_for(lambda: _ready(addr, gen) == NOT, 10, "not ready once the decode node is gone")
        assert (_ready(addr, ""), _http_health(r.http_port)) == (SERVING, 503)
        assert probes() == ((503, "no_decode_node"), (200, "ok"))
        with _nodes(port, ckpt, prefill=False):
            wait_for(lambda: _ready(addr, gen) == SERVING, 30, "ready again")
            r.drain(0)
            assert (_ready(addr, gen), _ready(addr, ""), _http_health(r.http_port)) == (NOT, SERVING, 503)
            assert probes() == ((503, "draining"), (200, "ok"))
    finally:
        r.stop(0)


def test_a_node_metrics_port_answers_its_readiness_and_liveness(ckpt, monkeypatch):
    """A decode node's plain-HTTP metrics port: /health 503 "starting" while its gRPC server is not
    serving yet (held here), 200 once it serves, 503 "draining" once it drains, as its gRPC
    readiness; /live 200 throughout; /metrics still served beside them."""
    import threading

    import serving.node
    from decode_node.config import DecodeNodeConfig
    from decode_node.server import DecodeNode

    SERVING, NOT = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    node = DecodeNode(DecodeNodeConfig(model=str(ckpt), dtype="float32", metrics_port=0, block_size=BLOCK))
    go, real = threading.Event(), serving.node.start_server

    def held(*a, **kw):
        assert go.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(serving.node, "start_server", held)
    t = threading.Thread(target=node.start, args=("127.0.0.1:0",), daemon=True)
    t.start()
    try:
        wait_for(lambda: node.metrics_port is not None, 10, "the metrics port bound")
        mp = node.metrics_port
        assert (_http_get(mp), _http_get(mp, "/live")) == ((503, "starting"), (200, "ok"))
        go.set()
        t.join(30)
        assert (_http_get(mp), _http_get(mp, "/live")) == ((200, "ok"), (200, "ok"))
        assert _ready(node.address, "pdserve.v1.DecodeNode") == SERVING
        with urllib.request.urlopen(f"http://127.0.0.1:{mp}/metrics", timeout=5) as resp:
            assert b"vllm:num_requests_waiting" in resp.read()
        assert node.drain(0)
        assert (_http_get(mp), _http_get(mp, "/live")) == ((503, "draining"), (200, "ok"))
        assert _ready(node.address, "pdserve.v1.DecodeNode") == NOT
    finally:
        go.set()
        t.join(30)
        node.stop(0)


def test_a_reservation_waiting_for_its_transfer_is_a_waiting_request(cluster):
    """vLLM counts a request whose KV is still to come from a remote prefill as waiting: so does a
    decode node's vllm:num_requests_waiting (its own gauges keep the two apart: queue_depth, the
    engine's queue; reservations, those set aside for a transfer), back to 0 once released."""
    from serving.rpc import channel
    from serving.security import OPEN

    r, urls, _ = cluster
    d = r.registry.live(pb.NODE_KIND_DECODE)[0].info.address
    waiting = next(k for k in scrape(urls["decode"]) if k[0] == "vllm:num_requests_waiting")
    wait_for(lambda: scrape(urls["decode"])[waiting] == 0, 10, "an idle decode node")
    with channel(d, OPEN) as ch:
        stub = rpc.DecodeNodeStub(ch)
        sp = pb.SamplingParams(max_tokens=4)
        stub.Reserve(
            pb.ReserveRequest(request_id="held", prompt_token_ids=[3] * 20, sampling=sp, lease_s=30), timeout=30
        )
        try:
            s = scrape(urls["decode"])
            assert s[waiting] == 1 and s[("vllm:num_requests_running", waiting[1])] == 0
            assert (s[("pdserve_decode_reservations", ())], s[("pdserve_decode_queue_depth", ())]) == (1, 0)
        finally:
            stub.Release(pb.ReleaseRequest(request_id="held"), timeout=30)
    s = scrape(urls["decode"])
    assert s[waiting] == 0 and s[("pdserve_decode_reservations", ())] == 0
