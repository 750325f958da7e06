"""SGLang's native `POST /generate` against `pdserve up` (one prefill and one decode node): greedy
`input_ids` give transformers' greedy tokens, their logprobs and the prompt's (logprob_start_len 0,
top_logprobs_num 2) transformers' log-softmax; the stream's events are cumulative and end with the
whole answer; a text prompt stops at a stop string (trimmed, and kept with no_stop_trim); a batch
answers a list; json_schema output validates, greedy and sampled (n=2, streamed, each event naming
its output); bad input is a 400 naming the field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import torch

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import log_url

NEW = 8


def _base(up) -> str:
    return log_url(up, r"OpenAI-compatible HTTP on (http://\S+)/v1")


def _post(base: str, body) -> tuple[int, object]:
    req = urllib.request.Request(base + "/generate", json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if isinstance(body, dict) and body.get("stream"):
        events = [x[6:] for x in raw.split("\n\n") if x.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-1]
        return 200, [json.loads(x) for x in events[:-1]]
    return 200, json.loads(raw)


def _log_softmax(ckpt, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at every position (row p predicts token p + 1)."""
    with torch.inference_mode():
        return torch.log_softmax(hc._hf_model(ckpt)(torch.tensor([ids])).logits[0].float(), -1)


def test_greedy_ids_logprobs_and_stream(http_up, ckpt):
    base = _base(http_up)
    prompt = hc.prompts(lens=(12,), seed=11)[0]
    sp = {"max_new_tokens": NEW, "min_new_tokens": NEW, "temperature": 0.0}
    body = {"input_ids": prompt, "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 2}
    status, out = _post(base, body | {"logprob_start_len": 0, "rid": "greedy-1"})
    assert status == 200, out
    assert isinstance(out, dict)
    want = hc.hf_greedy(ckpt, prompt, NEW)
    assert out["output_ids"] == want
    meta = out["meta_info"]
    assert meta["id"] == "greedy-1" and meta["finish_reason"] == {"type": "length", "length": NEW}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), NEW)
    assert meta["e2e_latency"] > 0 and meta["cached_tokens"] >= 0
    http_up.find(rf"(request greedy-1-\w{{8}}): prompt {len(prompt)}, .* {NEW} tokens, length")  # the router's line
    ref = _log_softmax(ckpt, prompt + want)
    outs = meta["output_token_logprobs"]
    assert [e[1] for e in outs] == want and all(e[2] is None for e in outs)
    for k, (lp, t, _) in enumerate(outs):
        assert abs(lp - ref[len(prompt) - 1 + k, t].item()) < 1e-4, (k, lp)
    for k, tops in enumerate(meta["output_top_logprobs"]):
        best = ref[len(prompt) - 1 + k].topk(2)
        assert [e[1] for e in tops] == best.indices.tolist()
        assert max(abs(e[0] - v) for e, v in zip(tops, best.values.tolist(), strict=True)) < 1e-4
    ins = meta["input_token_logprobs"]
    assert [e[1] for e in ins] == prompt and ins[0][0] is None and meta["input_top_logprobs"][0] is None
    for p in range(1, len(prompt)):
        assert abs(ins[p][0] - ref[p - 1, prompt[p]].item()) < 1e-4, p
    # streamed: each event holds the output so far; the last one is the whole answer
    status, events = _post(base, body | {"stream": True})
    assert status == 200 and isinstance(events, list) and len(events) >= 2
    for a, b in zip(events, events[1:], strict=False):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"] and b["text"].startswith(a["text"])
        assert a["meta_info"]["finish_reason"] is None
    last = events[-1]
    assert last["output_ids"] == want and last["text"] == out["text"]
    assert last["meta_info"]["output_token_logprobs"] == outs
    assert "input_token_logprobs" not in last["meta_info"] or last["meta_info"]["input_token_logprobs"] == []


def test_text_stop_string_batch_and_json_schema(http_up):
    import jsonschema

    from tests.structured.cases import SCHEMA

    base = _base(http_up)
    sp = {"max_new_tokens": 24, "min_new_tokens": 24, "temperature": 0.0}
    status, free = _post(base, {"text": "Hello world, the answer is", "sampling_params": sp})
    assert status == 200, free
    assert isinstance(free, dict)
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text[: text.index(stop)]
    sp_stop = sp | {"min_new_tokens": 0, "stop": [stop]}
    status, got = _post(base, {"text": ["Hello world, the answer is"] * 2, "sampling_params": sp_stop})
    assert status == 200 and isinstance(got, list) and len(got) == 2, got
    for one in got:
        assert one["text"] == cut
        assert one["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    status, kept = _post(
        base, {"text": "Hello world, the answer is", "sampling_params": sp_stop | {"no_stop_trim": True}}
    )
    assert status == 200 and isinstance(kept, dict) and kept["text"] == cut + stop
    js = {"max_new_tokens": 80, "temperature": 0.0, "json_schema": json.dumps(SCHEMA)}
    status, out = _post(base, {"text": "JSON:", "sampling_params": js})
    assert status == 200 and isinstance(out, dict), out
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    # sampled, n=2, streamed: each event names its output; the last of each validates
    js |= {"temperature": 1.0, "top_p": 0.9, "n": 2, "sampling_seed": 3}
    status, events = _post(base, {"text": "JSON:", "sampling_params": js, "stream": True})
    assert status == 200 and isinstance(events, list), events
    last = {e["index"]: e for e in events}
    assert sorted(last) == [0, 1]
    for e in last.values():
        assert e["meta_info"]["finish_reason"]["type"] == "stop", e
        jsonschema.validate(json.loads(e["text"]), SCHEMA)


def test_bad_input_names_the_field(http_up):
    base = _base(http_up)
    for body, param in (
        ({"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": "8"}}, "sampling_params.max_new_tokens"),
        ({"text": "hi", "input_ids": [1, 2]}, "text"),
        ({}, "input_ids"),
        ({"input_ids": [1, -2]}, "input_ids"),
        ({"text": "hi", "image_data": "http://x/y.png"}, "image_data"),
        ({"text": "hi", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
        ({"text": "hi", "sampling_params": {"regex": "[a-"}}, "sampling_params.regex"),
        ({"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
        ({"text": "hi", "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"text": "hi", "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"text": "hi", "sampling_params": {"logit_bias": {"1": 2.0}}}, "sampling_params.logit_bias"),
    ):
        status, out = _post(base, body)
        assert status == 400, (body, out)
        assert isinstance(out, dict) and out["error"]["param"] == param, (body, out)
        assert param.split(".")[-1] in out["error"]["message"], out
    status, out = _post(base, ["not", "an", "object"])
    assert status == 400 and isinstance(out, dict) and "JSON object" in out["error"]["message"]
    # an unknown field has no effect (logged once), as on the OpenAI routes
    status, out = _post(base, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "unknown": 1})
    assert status == 200 and isinstance(out, dict) and out["meta_info"]["completion_tokens"] == 2, out
