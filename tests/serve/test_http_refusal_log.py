"""A router's HTTP refusals are in its log: a request refused before it reached the service (a bad
parameter, no node to serve it, a stored response this router does not hold, a missing API key)
left no line at all, so an operator looking into a client's 400s found nothing. Each is now one
INFO line with the method, path, status, time and the error message the client got; and
`http_requests_total` names the stored-response routes (they were counted as `other`)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

from tests.helpers.serve_harness import Proc, log_url, scrape, wait_for

KEY = "sk-refusal-log-test"


def _call(base: str, method: str, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    req = urllib.request.Request(
        base + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_every_refusal_is_one_log_line_with_its_message(ckpt):
    # a router alone: these requests are refused before any node would be asked
    r = Proc(
        "router",
        "--port",
        "0",
        "--model",
        ckpt,
        "--http-port",
        "0",
        "--metrics-port",
        "0",
        "--served-model-name",
        "tiny",
        ready=r"router listening on (\S+)",
        env={"PDSERVE_API_KEY": KEY},
    )
    try:
        base = log_url(r, r"OpenAI-compatible HTTP on (http://\S+)/v1")
        metrics = log_url(r, r"router metrics at (http://\S+/metrics)")
        name = "tiny"
        cases = [
            ("POST", "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": -1}, KEY, 400),
            ("POST", "/v1/completions", {"model": "no-such-model", "prompt": "hi"}, KEY, 503),  # no node yet
            ("GET", "/v1/responses/resp_0123", None, KEY, 404),
            ("POST", "/v1/responses", {"model": name, "input": "hi", "previous_response_id": "resp_9"}, KEY, 400),
            ("POST", "/v1/chat/completions", {"model": name, "messages": []}, None, 401),
        ]
        for method, path, body, key, want in cases:
            status, answer = _call(base, method, path, body, key)
            assert status == want, (path, status, answer)
            message = " ".join(answer["error"]["message"].split())
            line = wait_for(
                lambda m=method, p=path, s=status: next(
                    (ln for ln in r.lines if re.search(rf"INFO pdserve\.router: http {m} {re.escape(p)}: {s} in ", ln)),
                    None,
                ),
                10,
                f"the log line of {method} {path}",
            )
            assert message[:150] in line, (message, line)  # what the client was told
        assert _call(base, "GET", "/v1/models")[0] == 200
        got = scrape(metrics)
        counts = {dict(k[1])["route"]: v for k, v in got.items() if k[0] == "pdserve_router_http_requests_total"}
        assert counts.get("/v1/responses/{id}") == 1 and "other" not in counts, counts
    finally:
        assert r.stop() == 0, r.output()
    assert not any(" http GET /v1/models" in ln for ln in r.lines)  # answered: no refusal line
