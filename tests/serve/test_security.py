"""Who gets in (serving/security.py, router/auth.py), with real processes: one `pdserve up` cluster
over TLS (a CA made here), client API keys from a file, the cluster token, a per-key limit.

- the disaggregated path works over TLS, token for token as transformers;
- HTTP and gRPC without a key or with a wrong one are refused (401 in OpenAI's shape,
  UNAUTHENTICATED), with a key they answer; /health and /metrics stay open;
- a process holding a client API key but not the cluster token cannot Register, ListNodes,
  Reserve, Prefill or Handshake, and a wrong token is PERMISSION_DENIED; nothing changes on the nodes;
- nodes require a client certificate the CA signed (mutual TLS), the router a TLS client;
- a key over its in-flight limit gets 429 / RESOURCE_EXHAUSTED while another key is served;
- a standalone server without a token refuses to start unless told `--insecure-open-cluster`.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from tests.helpers.serve_harness import (
    NEW,
    ROOT,
    Up,
    creds,
    decode_stats,
    flags,
    greedy_through_transfer,
    log_url,
    node_info,
    nodes,
    wait_for,
)
from tests.helpers.tls_ca import CA

KEY_A, KEY_B = "sk-test-alpha-0123456789", "sk-test-bravo-9876543210"
LIMIT = 2  # --max-requests-per-key


@pytest.fixture(scope="module")
def secure(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca = CA(d)
    srv = ca.issue("pdserve")  # one certificate for every component (127.0.0.1, localhost)
    keys = d / "api-keys"
    keys.write_text(f"# client keys\n{KEY_A}\n\n{KEY_B}\n")
    up = Up(
        "--model",
        ckpt,
        *flags(
            dtype="float32",
            prefill=1,
            decode=1,
            local_prefill_threshold=0,
            http_port=0,
            tls_cert=srv.cert,
            tls_key=srv.key,
            tls_ca=ca.ca,
            api_key_file=keys,
            max_requests_per_key=LIMIT,
        ),
    )
    from serving.security import Tls

    (d / "other").mkdir()
    up.ca, up.other_ca, up.tls = ca, CA(d / "other", "another CA"), Tls.from_files(srv.cert, srv.key, ca.ca)
    up.http = log_url(up, r"router OpenAI-compatible HTTP at (https://\S+)/v1")
    yield up
    rc = up.stop()
    assert rc == 0, up.output()
    for secret in (KEY_A, KEY_B, "serve-tests-cluster-token"):
        assert secret not in "".join(up.lines), "a secret reached the logs"


def _https(up, method: str, path: str, key: str | None = None, body: dict | None = None, x_api_key: bool = False):
    """(status, parsed body, headers) of one HTTPS request that checks the router's certificate
    (the key as `Authorization: Bearer`, or as Anthropic's clients send it, `x-api-key`)."""
    auth = ({"x-api-key": key} if x_api_key else {"Authorization": f"Bearer {key}"}) if key else {}
    headers = {"Content-Type": "application/json"} | auth
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(up.http + path, data=data, headers=headers, method=method)
    ctx = ssl.create_default_context(cafile=up.ca.ca)
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=120) as r:
            raw, status, hdrs = r.read(), r.status, r.headers
    except urllib.error.HTTPError as e:
        raw, status, hdrs = e.read(), e.code, e.headers
    ctype = hdrs.get("Content-Type", "")
    return status, json.loads(raw) if ctype.startswith("application/json") else raw.decode(), hdrs


def test_disaggregated_path_over_tls(secure, refs):
    ps, want = refs
    node_creds = creds(secure.tls)
    greedy_through_transfer(
        secure.address, ps, want, LIMIT, "over TLS: ", node_creds, api_key=KEY_A, tls_ca=secure.ca.ca
    )
    for n in nodes(secure.address, node_creds):
        assert n.alive


def test_http_needs_an_api_key(secure, refs):
    ps, want = refs
    body = {
        "model": node_info(secure.address, "decode-0", creds(secure.tls)).model,
        "prompt": ps[1],
        "max_tokens": NEW,
        "temperature": 0,
    }
    for key in (None, "sk-wrong", KEY_A + "x", KEY_A[:-1]):
        status, err, hdrs = _https(secure, "POST", "/v1/completions", key, body)
        assert status == 401 and hdrs["WWW-Authenticate"] == "Bearer", (key, status, err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["code"] == "invalid_api_key"
        assert _https(secure, "GET", "/v1/models", key)[0] == 401
    status, out, _ = _https(secure, "POST", "/v1/completions", KEY_B, body)
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == NEW
    assert _https(secure, "GET", "/v1/models", KEY_A)[0] == 200
    msg = {"model": body["model"], "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert _https(secure, "POST", "/v1/messages", KEY_A + "x", msg, x_api_key=True)[0] == 401
    status, out, _ = _https(secure, "POST", "/v1/messages", KEY_A, msg, x_api_key=True)
    assert status == 200 and out["usage"]["output_tokens"] == 2, out
    assert _https(secure, "GET", "/health")[0] == 200  # open, as /metrics
    status, text, _ = _https(secure, "GET", "/metrics")
    assert status == 200 and "pdserve_router_requests_total" in text


def test_grpc_needs_an_api_key(secure):
    from client import Client, PdserveError

    for key in ("", "sk-wrong"):
        with Client(secure.address, api_key=key, tls_ca=secure.ca.ca) as c:
            for call in (lambda: c.generate(prompt_token_ids=[1, 2, 3], max_tokens=2), c.list_models):  # noqa: B023
                with pytest.raises(PdserveError) as ei:
                    call()
                assert ei.value.code == grpc.StatusCode.UNAUTHENTICATED, ei.value
    with Client(secure.address, api_key=KEY_A, tls_ca=secure.ca.ca) as c:
        assert len(c.generate(prompt_token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True).token_ids) == 2
    # a key read from a file (its newline dropped), the CA as PEM text
    with Client(secure.address, api_key=KEY_A + "\n", tls_ca=Path(secure.ca.ca).read_text()) as c:
        assert len(c.generate(prompt_token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True).token_ids) == 2
    # in plain text the router is not reached; under another CA its certificate is not trusted
    for kw in ({}, {"tls_ca": secure.other_ca.ca}):
        with Client(secure.address, api_key=KEY_A, **kw) as c:
            with pytest.raises(PdserveError) as ei:
                c.list_models()
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    # the command line: a key through the environment, none
    cmd = [sys.executable, "-m", "router.cli", "generate", "--addr", secure.address, "--tls-ca", secure.ca.ca]
    cmd += ["--token-ids", "1,2,3", "--max-tokens", "3", "--ignore-eos", "--wait", "20"]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"} | {"PYTHONPATH": str(ROOT)}
    ok = subprocess.run(cmd, env=env | {"PDSERVE_API_KEY": KEY_B}, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "3 tokens" in ok.stderr, ok.stderr
    t0 = time.monotonic()
    bad = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "UNAUTHENTICATED" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    assert time.monotonic() - t0 < 10, "a refused key waited out --wait 20"


def test_node_plane_needs_the_cluster_token(secure):
    """An outsider with a client API key, the CA and even a certificate the CA signed, but not the
    cluster token, cannot join or use the node plane."""
    from proto import pb, rpc
    from serving.rpc import channel
    from serving.security import AUTH_KEY, Credentials

    good = creds(secure.tls)
    d, p = node_info(secure.address, "decode-0", good), node_info(secure.address, "prefill-0", good)
    before = decode_stats(d.address, good).capacity
    rogue = pb.NodeInfo(node_id="rogue", kind=pb.NODE_KIND_DECODE, address="127.0.0.1:1", incarnation=7)
    sp = pb.SamplingParams(max_tokens=2)
    calls = {
        "Register": (secure.address, lambda ch: rpc.RegistryStub(ch).Register(pb.RegisterRequest(node=rogue))),
        "ListNodes": (secure.address, lambda ch: rpc.RegistryStub(ch).ListNodes(pb.ListNodesRequest())),
        "Reserve": (
            d.address,
            lambda ch: rpc.DecodeNodeStub(ch).Reserve(
                pb.ReserveRequest(request_id="rogue-1", prompt_token_ids=[1, 2, 3], sampling=sp)
            ),
        ),
        "Handshake": (d.address, lambda ch: rpc.DecodeNodeStub(ch).Handshake(pb.HandshakeRequest(node_id="rogue"))),
        "Stats": (p.address, lambda ch: rpc.PrefillNodeStub(ch).Stats(pb.StatsRequest())),
        "Prefill": (
            p.address,
            lambda ch: list(
                rpc.PrefillNodeStub(ch).Prefill(
                    pb.PrefillRequest(request_id="rogue-2", prompt_token_ids=[1, 2, 3], sampling=sp)
                )
            ),
        ),
    }
    md = ((AUTH_KEY, f"Bearer {KEY_A}"),)
    for token, want in ((None, grpc.StatusCode.UNAUTHENTICATED), (b"not-the-token", grpc.StatusCode.PERMISSION_DENIED)):
        outsider = Credentials(cluster_token=token, tls=secure.tls)
        for name, (addr, call) in calls.items():
            with channel(addr, outsider) as ch:
                ch = grpc.intercept_channel(ch, _Metadata(md))
                with pytest.raises(grpc.RpcError) as ei:
                    call(ch)
                assert ei.value.code() == want, (name, token, ei.value.code(), ei.value.details())
    assert sorted(n.node.node_id for n in nodes(secure.address, good)) == ["decode-0", "prefill-0"]
    assert decode_stats(d.address, good).capacity == before  # nothing reserved
    # mutual TLS: the token alone, without a certificate the CA signed, does not reach a node
    from serving.security import Tls

    with channel(d.address, Credentials(cluster_token=b"x", tls=Tls(ca=secure.tls.ca))) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            rpc.DecodeNodeStub(ch).Stats(pb.StatsRequest(), timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, md):
        self.md = md

    def _go(self, continuation, d, request):
        return continuation(d._replace(metadata=[*(d.metadata or ()), *self.md]), request)

    intercept_unary_unary = intercept_unary_stream = _go


def test_requests_in_flight_are_limited_per_key(secure):
    from client import Client, PdserveError

    with Client(secure.address, api_key=KEY_B, tls_ca=secure.ca.ca, timeout=120) as b:
        streams = [b.stream(prompt_token_ids=[5, 6, 7], max_tokens=2000, ignore_eos=True) for _ in range(LIMIT)]
        try:
            for s in streams:
                next(iter(s))  # both running
            with pytest.raises(PdserveError) as ei:
                b.generate(prompt_token_ids=[1, 2], max_tokens=2)
            assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-requests-per-key" in ei.value.message
            body = {"model": "m", "prompt": [1, 2], "max_tokens": 2}
            status, err, hdrs = _https(secure, "POST", "/v1/completions", KEY_B, body)
            assert status == 429 and err["error"]["type"] == "rate_limit_error" and hdrs["Retry-After"]
            with Client(secure.address, api_key=KEY_A, tls_ca=secure.ca.ca) as a:  # another key is served
                assert len(a.generate(prompt_token_ids=[1, 2], max_tokens=2, ignore_eos=True).token_ids) == 2
        finally:
            for s in streams:
                s.close()
        wait_for(lambda: _served(b), 30, "key B served again once its streams ended")


def _served(c) -> bool:
    from client import PdserveError

    try:
        return len(c.generate(prompt_token_ids=[1, 2], max_tokens=1).token_ids) == 1
    except PdserveError:
        return False


@pytest.mark.parametrize("cmd", ["router", "decode"])
def test_a_server_without_a_cluster_token_does_not_start(cmd, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN"} | {"PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "router.cli", cmd, "--port", "0"] + (["--model", str(tmp_path)] * (cmd == "decode"))
    r = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no cluster token" in r.stderr and "Traceback" not in r.stderr, r.stderr
    empty = tmp_path / "token"
    empty.write_text("\n")
    r = subprocess.run([*base, "--cluster-token-file", str(empty)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is empty" in r.stderr, r.stderr


def test_credentials_are_described_in_words_without_secrets():
    from serving.security import Credentials

    c = Credentials(cluster_token=b"s3cret-token", api_keys=(b"d1", b"d2"))
    assert c.describe() == "cluster token set, 2 client API keys, TLS off"
    assert "s3cret" not in c.describe() + repr(c)
    assert Credentials().describe() == "no cluster token (open node plane), no client API keys, TLS off"
