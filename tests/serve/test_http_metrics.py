"""OpenAI-compatible HTTP and Prometheus /metrics against a running `pdserve up` (one prefill + one
decode node, tiny model with a tokenizer): the official `openai` client for completions and chat
completions, streamed and not, gives the SDK's greedy text; bad parameters give OpenAI's error
shape; every server's /metrics parses as Prometheus exposition and its counters move by exactly
the requests sent."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.helpers.serve_harness import (
    BLOCK,
    NEW,
    Up,
    check_decode_prefix_reuse,
    flags,
    log_url,
    nodes,
    scrape,
    wait_for,
)

PROMPT = "Hello world! How are you"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
GREEDY = dict(max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
# thinking off: the whole answer is content (reasoning: tests/serve/test_agents.py)
NO_THINK = dict(GREEDY, extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})


@pytest.fixture(scope="module")
def up(ckpt):
    # every turn through the prefill node (its prefix metrics, the transfer's reuse of pages)
    opts = flags(dtype="float32", decode=1, prefill=1, http_port=0, metrics_port=0, block_size=BLOCK)
    u = Up("--model", ckpt, *opts, "--local-resume-threshold", "0")
    yield u
    rc = u.stop()
    assert rc == 0, u.output()


@pytest.fixture(scope="module")
def base_url(up):
    return log_url(up, r"OpenAI-compatible HTTP on (http://\S+/v1)")


@pytest.fixture(scope="module")
def oai(base_url):
    import openai

    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(up):
    from client import Client

    with Client(up.address, timeout=120) as c:
        c.wait_ready(timeout=60)
        yield c


def _sdk_text(sdk, prompt: str) -> str:
    return sdk.generate(prompt=prompt, max_tokens=8, temperature=0.0, ignore_eos=True).text


def test_models_and_completions(oai, sdk, ckpt):
    models = [m.id for m in oai.models.list().data]
    assert len(models) == 1
    want = _sdk_text(sdk, PROMPT)
    assert want
    r = oai.completions.create(model=models[0], prompt=PROMPT, **GREEDY)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    chunks = list(oai.completions.create(model=models[0], prompt=PROMPT, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completions(oai, sdk, ckpt):
    from transformers import AutoTokenizer

    model = oai.models.list().data[0].id
    prompt = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    want = _sdk_text(sdk, prompt)
    r = oai.chat.completions.create(model=model, messages=MESSAGES, **NO_THINK)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    chunks = list(oai.chat.completions.create(model=model, messages=MESSAGES, stream=True, **NO_THINK))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_bad_parameters_give_openai_errors(oai, base_url):
    import openai

    model = oai.models.list().data[0].id
    for kw, param in (
        (dict(temperature=-1.0), "temperature"),
        (dict(n=17), "n"),
        (dict(logit_bias={"5": 101.0}), "logit_bias"),
        (dict(max_tokens=-1), "max_tokens"),
    ):
        with pytest.raises(openai.BadRequestError) as ei:
            oai.completions.create(model=model, prompt=PROMPT, **kw)
        assert ei.value.status_code == 400
        assert ei.value.body["param"] == param and ei.value.body["message"], ei.value.body
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=model, messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    # a prompt no node can take: the router's INVALID_ARGUMENT, mapped to 400 in the same shape
    req = urllib.request.Request(
        base_url + "/completions",
        method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"model": model, "prompt": [10**6], "max_tokens": 4}).encode(),
    )
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=60)
    assert ei.value.code == 400
    err = json.loads(ei.value.read())["error"]
    assert set(err) == {"message", "type", "param", "code"} and "out of range" in err["message"], err


def test_metrics_count_requests(up, sdk):
    from client import PdserveError

    urls = {
        "router": log_url(up, r"router metrics at (http://\S+/metrics)"),
        "decode": log_url(up, r"decode node decode-0 metrics at (http://\S+/metrics)"),
        "prefill": log_url(up, r"prefill node prefill-0 metrics at (http://\S+/metrics)"),
    }
    wait_for(lambda: len([n for n in nodes(up.address) if n.alive]) == 2, 20, "both nodes alive")
    before = {k: scrape(u) for k, u in urls.items()}
    k, new = 3, 5
    for i in range(k):
        r = sdk.generate(prompt_token_ids=[5 + i] * 20, max_tokens=new, temperature=0.0, ignore_eos=True)
        assert len(r.token_ids) == new and r.prefill_node == "prefill-0"
    with pytest.raises(PdserveError):
        sdk.generate(prompt_token_ids=[10**6], max_tokens=2)  # refused by the router: one error
    after = {k: scrape(u) for k, u in urls.items()}

    def moved(server: str, name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[server][key] - before[server].get(key, 0.0)

    r = "pdserve_router"
    assert moved("router", f"{r}_requests_total", outcome="ok") == k
    assert moved("router", f"{r}_requests_total", outcome="error") == 1
    assert moved("router", f"{r}_requests_total", outcome="cancelled") == 0
    assert moved("router", f"{r}_generated_tokens_total") == k * new
    assert moved("router", f"{r}_ttft_seconds_count") == k
    assert moved("router", f"{r}_tpot_seconds_count") == k
    assert moved("router", f"{r}_e2e_seconds_count") == k  # the refused one made no token
    assert moved("router", f"{r}_prompt_tokens_total") == k * 20
    assert 0 <= after["router"][(f"{r}_kv_pages_usage", ())] <= 1
    assert moved("router", f"{r}_transfers_total") == k
    assert moved("router", f"{r}_transfer_bytes_total") > 0
    assert after["router"][(f"{r}_queue_depth", ())] == 0
    assert after["router"][(f"{r}_kv_pages_free", ())] > 0

    d, p = "pdserve_decode", "pdserve_prefill"
    assert moved("decode", f"{d}_requests_total", outcome="ok") == k
    assert moved("decode", f"{d}_transfers_total") == k
    assert moved("prefill", f"{p}_requests_total", outcome="ok") == k
    assert moved("prefill", f"{p}_transfers_total") == k
    assert moved("prefill", f"{p}_transfer_failures_total") == 0
    assert moved("prefill", f"{p}_transfer_bytes_total") == moved("router", f"{r}_transfer_bytes_total")
    # the prefill node makes each first token, the decode node the rest
    assert moved("prefill", f"{p}_generated_tokens_total") == k
    assert moved("decode", f"{d}_generated_tokens_total") == k * (new - 1)
    for server, pre in (("decode", d), ("prefill", p)):
        s = after[server]
        total = s[(f"{pre}_kv_pages_free", ())] + s[(f"{pre}_kv_pages_used", ())]
        assert total > 0 and s[(f"{pre}_state_slots_free", ())] > 0
        assert (f"{pre}_queue_depth", ()) in s


class _Rpc(Exception):
    def __init__(self, code, details):
        self._c, self._d = code, details

    def code(self):
        return self._c

    def details(self):
        return self._d


@pytest.mark.parametrize(
    "code,status",
    [("INVALID_ARGUMENT", 400), ("RESOURCE_EXHAUSTED", 429), ("UNAVAILABLE", 503), ("INTERNAL", 500)],
    ids=lambda v: str(v),
)
def test_grpc_codes_map_to_http(code, status):
    import grpc

    from router.openai_models import ApiError

    e = ApiError.from_rpc(_Rpc(getattr(grpc.StatusCode, code), "why"))
    assert e.status == status
    assert e.body() == {"error": {"message": "why", "type": e.type, "param": None, "code": code.lower()}}


def test_openai_parameters_map_to_sampling():
    from router.openai_models import ApiError, CompletionRequest, parse, sampling

    def sampling_of(body: dict):
        return sampling(parse(CompletionRequest, {"model": "m", "prompt": "x", **body}))

    sp = sampling_of({"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": [5, 6], "n": 1})
    assert (sp.max_tokens, sp.temperature, round(sp.top_p, 6), sp.seed, list(sp.stop_token_ids)) == (
        7,
        0.5,
        0.9,
        3,
        [5, 6],
    )
    assert not sampling_of({}).HasField("max_tokens")  # unset: the server's defaults
    for bad, param in (
        ({"top_p": 1.5}, "top_p"),
        ({"seed": "x"}, "seed"),
        ({"stop": [1.5]}, "stop"),
        ({"max_tokens": True}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
    ):
        with pytest.raises(ApiError) as ei:
            sampling_of(bad)
        assert ei.value.status == 400 and ei.value.param == param, bad


def test_prefix_cache_hits_reach_sdk_usage_and_metrics(up, sdk, oai):
    """A prompt, then two that extend it: the prefill node resumes them from the first one's
    end-of-prompt snapshot, and each layer reports the tokens it skipped."""
    url = log_url(up, r"prefill node prefill-0 metrics at (http://\S+/metrics)")
    p = "pdserve_prefill"
    before = scrape(url)
    ids = [300 + i for i in range(37)]  # 37 tokens: two full pages and a partial one
    first = sdk.generate(prompt_token_ids=ids, max_tokens=2, temperature=0.0, ignore_eos=True)
    assert first.cached_tokens == 0 and first.prefill_node == "prefill-0"
    again = sdk.generate(prompt_token_ids=ids + [9, 8], max_tokens=2, temperature=0.0, ignore_eos=True)
    assert again.cached_tokens == len(ids) and again.prompt_tokens == len(ids) + 2
    model = oai.models.list().data[0].id
    r = oai.completions.create(model=model, prompt=ids + [7, 6, 5], **GREEDY)
    assert r.usage.prompt_tokens_details.cached_tokens == len(ids) and r.usage.prompt_tokens == len(ids) + 3
    after = scrape(url)

    def moved(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0.0)

    assert moved(f"{p}_prefix_hit_tokens_total") == 2 * len(ids)
    assert moved(f"{p}_prefix_miss_tokens_total") == len(ids) + 2 + 3
    assert after[(f"{p}_prefix_snapshots_used", ())] >= 3 and after[(f"{p}_prefix_snapshot_memory_bytes", ())] > 0


def test_second_turn_moves_only_its_new_pages(up, ckpt):
    """TP 1 -> 1: the decode node holds the first turn's prompt and reply pages; the second turn's
    transfer skips them, both turns give transformers' greedy tokens, and the decode node's
    metrics count the skipped pages as prefix-cache hits."""
    url = log_url(up, r"decode node decode-0 metrics at (http://\S+/metrics)")
    before = scrape(url)
    turn1, turn2 = check_decode_prefix_reuse(ckpt, up.address)
    after = scrape(url)

    def moved(name: str) -> float:
        return after[(f"pdserve_decode_{name}", ())] - before.get((f"pdserve_decode_{name}", ()), 0.0)

    held = (len(turn1) + NEW - 1) // BLOCK * BLOCK  # turn 1's full pages of computed tokens
    assert moved("prefix_hit_tokens_total") == held
    # the decode node's line for turn 2 names the pages it had (it said "cached 0")
    wait_for(lambda: f"prompt {len(turn2)} (cached {held})," in up.output(), 10, "the decode node's line for turn 2")
    assert moved("prefix_miss_tokens_total") == len(turn1) + len(turn2) - held
