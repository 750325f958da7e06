"""proto/convert.py: wire SamplingParams -> the engine's keyword arguments, and logprobs -> wire."""

from __future__ import annotations

import dataclasses

from engine.sampling_params import SamplingParams
from proto import pb
from proto.convert import ROUTER_FIELDS, SamplingKwargs, logprobs_pb, sampling_kwargs


def test_kwargs_name_the_wire_fields_and_the_engines():
    """The TypedDict is written out by hand (proto imports nothing of the engine): one key per
    wire field but the text's (ROUTER_FIELDS: the router's), each a SamplingParams field."""
    keys = set(SamplingKwargs.__annotations__)
    assert keys == set(pb.SamplingParams.DESCRIPTOR.fields_by_name) - ROUTER_FIELDS
    assert keys <= {f.name for f in dataclasses.fields(SamplingParams)}


def test_unset_optional_fields_leave_the_engine_defaults():
    kw = sampling_kwargs(pb.SamplingParams())
    assert kw == {
        "top_k": 0,
        "ignore_eos": False,
        "stop_token_ids": (),
        "min_tokens": 0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    assert SamplingParams(**kw) == SamplingParams()


def test_set_fields_come_through():
    sp = pb.SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_k=3,
        top_p=0.75,
        min_p=0.25,
        seed=2**40,
        stop_token_ids=[5, 9],
        ignore_eos=True,
        min_tokens=2,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        repetition_penalty=1.5,
        logprobs=4,
        prompt_logprobs=0,
        stop=["END"],
        num_speculative_tokens=0,
        logit_bias={11: -100.0, 3: 2.5},
    )
    kw = sampling_kwargs(sp)
    assert kw == {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_k": 3,
        "top_p": 0.75,
        "min_p": 0.25,
        "seed": 2**40,
        "stop_token_ids": (5, 9),
        "ignore_eos": True,
        "min_tokens": 2,
        "presence_penalty": 0.25,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.5,
        "logprobs": 4,
        "prompt_logprobs": 0,  # set to 0 is not unset
        "num_speculative_tokens": 0,
        "logit_bias": {11: -100.0, 3: 2.5},
    }  # no "stop": the router's
    params = SamplingParams(**kw)
    assert params.logit_bias == ((3, 2.5), (11, -100.0)) and params.prompt_logprobs == 0


def test_logprobs_to_the_wire():
    out = logprobs_pb([(4, -0.5, [(4, -0.5), (8, -1.25)]), (2, -3.0, [])])
    assert [(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in out] == [
        (4, -0.5, [(4, -0.5), (8, -1.25)]),
        (2, -3.0, []),
    ]
