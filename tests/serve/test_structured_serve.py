"""Structured outputs through `pdserve up` with one prefill and one decode node (every prompt
prefilled on the prefill node) and MTP drafts: the prefill node samples the first token under the
mask, the decode node rebuilds the matcher from the tokens already produced and verifies its
drafts under the mask, so each constraint kind's output passes its independent check, greedy and
seeded; a bad constraint is INVALID_ARGUMENT naming the problem and the cluster keeps serving."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from engine.tiny_model import make_tiny_model
from engine.tokenizer import Tokenizer
from tests.helpers.serve_harness import SPEC, Up, flags
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
