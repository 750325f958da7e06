"""Structured outputs through `pdserve up` with one prefill and one decode node (every prompt
prefilled on the prefill node) and MTP drafts: the prefill node samples the first token under the
mask, the decode node rebuilds the matcher from the tokens already produced and verifies its
drafts under the mask, so each constraint kind's output passes its independent check, greedy and
seeded; a bad constraint is INVALID_ARGUMENT naming the problem and the cluster keeps serving.
Over HTTP, SGLang's `json_schema` field and vLLM's compact JSON (`disable_any_whitespace`) hold
with n=2, sampled and streamed."""

from __future__ import annotations

import dataclasses
import json
import re

import grpc
import pytest

from engine.tiny_model import make_tiny_model
from engine.tokenizer import Tokenizer
from tests.helpers.serve_harness import SPEC, Up, flags, log_url
from tests.structured.cases import CONSTRAINTS, check, object_bias

PROMPT = "Hello world, the answer is"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    spec = dataclasses.replace(SPEC, mtp=True, tokenizer=True)
    return str(make_tiny_model(tmp_path_factory.mktemp("serve-structured") / "ckpt", spec))


@pytest.fixture(scope="module")
def up(ckpt):
    up = Up(
        "--model",
        ckpt,
        *flags(
            dtype="float32",
            prefill=1,
            decode=1,
            local_prefill_threshold=0,
            speculative_method="mtp",
            num_speculative_tokens=2,
            kv_cache_memory="64MiB",
            http_port=0,
        ),
    )
    yield up
    assert up.stop() == 0, up.output()


def test_constrained_across_the_pools(up, ckpt):
    from client import Client

    tok = Tokenizer(ckpt)
    with Client(up.address, timeout=120) as c:
        c.wait_ready(timeout=60)
        free = c.generate(PROMPT, max_tokens=1, temperature=0.0)
        for kind, cons in CONSTRAINTS.items():
            bias = object_bias(tok) if kind == "json_object" else None
            for temperature, seed in ((0.0, None), (1.0, 7)):
                r = c.generate(
                    PROMPT, max_tokens=80, temperature=temperature, seed=seed, constraint=cons, logit_bias=bias
                )
                assert r.prefill_node == "prefill-0" and r.finish_reason == "stop", (kind, r.text)
                check(kind, r.text)
                if kind == "regex":  # the unconstrained first token is not a lower-case letter
                    assert free.token_ids[0] != r.token_ids[0]


def test_bad_constraint_is_invalid_argument(up):
    from client import Client, PdserveError

    with Client(up.address, timeout=60) as c:
        c.wait_ready(timeout=60)
        with pytest.raises(PdserveError) as e:
            c.generate(PROMPT, max_tokens=4, constraint={"kind": "regex", "value": "[a-z"})
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "unclosed character class" in str(e.value)
        r = c.generate(PROMPT, max_tokens=8, constraint={"kind": "choice", "value": ["yes", "no"]})
        assert r.text in ("yes", "no")


def _outside_strings(text: str) -> str:
    """The JSON text less its string literals."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def test_http_json_fields_of_other_engines(up):
    import jsonschema
    import openai

    from tests.structured.cases import SCHEMA

    url = log_url(up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:
        model = c.models.list().data[0].id
        common = dict(model=model, messages=[{"role": "user", "content": "JSON?"}], max_tokens=60, n=2)
        common |= dict(temperature=1.0, top_p=0.9, seed=3)
        nt = {"chat_template_kwargs": {"enable_thinking": False}}
        # SGLang's json_schema (the schema's JSON text): once ignored, the answer was free text
        r = c.chat.completions.create(**common, extra_body=nt | {"json_schema": json.dumps(SCHEMA)})
        for ch in r.choices:
            assert ch.finish_reason == "stop", ch
            jsonschema.validate(json.loads(ch.message.content), SCHEMA)
        # vLLM's compact JSON, streamed: once ignored, blanks came between the tokens
        body = nt | {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
        texts = ["", ""]
        for ev in c.chat.completions.create(**common, stream=True, extra_body=body):
            for ch in ev.choices:
                texts[ch.index] += ch.delta.content or ""
        for t in texts:
            jsonschema.validate(json.loads(t), SCHEMA)
            assert not re.search(r"\s", _outside_strings(t)), t
