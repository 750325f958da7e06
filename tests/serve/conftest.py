"""Serving tests: real processes (`pdserve up` = router + node processes) on loopback ports.

One cluster per test module that asks for it (`cluster`; `http_up` and `oai` with the OpenAI HTTP
port too, for the official `openai` client) (a tiny Qwen3.5 checkpoint with a tokenizer, float32, one prefill
and one decode node, disaggregated: local-prefill threshold 0), started through the CLI exactly as a user would. Helpers live in
tests/helpers/serve_harness.py.
"""

from __future__ import annotations

import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import LENS, NEW, SPEC, Up, log_url


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("serve") / "ckpt", SPEC)


@pytest.fixture(scope="session")
def refs(ckpt):
    """Prompts of LENS tokens and transformers' greedy NEW tokens after each."""
    ps = hc.prompts(lens=LENS, seed=5)
    return ps, [hc.hf_greedy(ckpt, p, NEW) for p in ps]


@pytest.fixture(scope="module")
def cluster(ckpt):
    up = Up("--model", ckpt, "--dtype", "float32", "--decode", "1", "--prefill", "1")
    yield up
    rc = up.stop()
    assert rc == 0, up.output()


@pytest.fixture()
def client(cluster):
    from client import Client

    c = Client(cluster.address, timeout=120)
    c.wait_ready(timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http_up(ckpt):
    u = Up("--model", ckpt, "--dtype", "float32", "--decode", "1", "--prefill", "1", "--http-port", "0")
    yield u
    rc = u.stop()
    assert rc == 0, u.output()


@pytest.fixture(scope="module")
def oai(http_up):
    import openai

    url = log_url(http_up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id
