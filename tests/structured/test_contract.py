"""The constraint contract: the engine's Constraint refuses bad input by name, and a constraint
round-trips client SDK -> wire -> engine SamplingParams -> dict and back."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("grpc_health", reason="the client SDK needs grpcio-health-checking (not in GPU images)")

from client.types import build_request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured import Constraint  # noqa: E402
from proto import pb  # noqa: E402
from proto.convert import constraint_kwargs, sampling_kwargs  # noqa: E402

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize(
    "kind,value,message",
    [
        ("regex", "[a-z", "unclosed character class"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", '{"type": "frob"}', "frob"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("grammar", "start: foo", 'unknown name: "foo"'),
        ("choice", [], "at least one choice"),
        ("choice", "yes", "list of strings"),
        ("yaml", "x", "kind must be one of"),
        ("", "", "kind must be one of"),
        ("regex", "", "non-empty string"),
    ],
    ids=[
        "regex",
        "schema-json",
        "schema-type",
        "schema-array",
        "grammar",
        "choice-empty",
        "choice-str",
        "kind",
        "nokind",
        "empty",
    ],
)
def test_bad_constraints_are_refused_by_name(kind, value, message):
    with pytest.raises(ValueError, match="constraint|json_schema|choice") as e:
        SamplingParams(constraint={"kind": kind, "value": value})
    assert message in str(e.value)


def test_min_tokens_with_a_constraint_is_refused():
    """A grammar that is complete allows only EOS, which min_tokens would ban: nothing left to draw."""
    with pytest.raises(ValueError, match="min_tokens cannot be combined with a constraint"):
        SamplingParams(min_tokens=3, constraint={"kind": "json_object"})


def test_bad_start_token_is_refused():
    with pytest.raises(ValueError, match="start_after_token"):
        Constraint("json_object", start_after_token=-1)


@pytest.mark.parametrize(
    "c",
    [
        {"kind": "json_schema", "value": SCHEMA},
        {"kind": "json_object", "start_after_token": 7},
        {"kind": "regex", "value": r"\d{3}-[a-z]+"},
        {"kind": "grammar", "value": 'start: "yes" | "no"'},
        {"kind": "choice", "value": ["red", 'gr"een', "blue\n"], "start_after_token": 0},
    ],
    ids=lambda c: c["kind"],
)
def test_round_trip_client_wire_engine(c):
    req = build_request(prompt_token_ids=[1, 2], constraint=c)
    wire = pb.GenerateRequest.FromString(req.SerializeToString())
    sp = SamplingParams(**sampling_kwargs(wire.sampling))
    want = Constraint(
        c["kind"],
        json.dumps(c["value"]) if isinstance(c.get("value"), dict) else c.get("value", ""),
        c.get("start_after_token"),
    )
    assert sp.constraint == want
    assert SamplingParams.from_dict(json.loads(json.dumps(sp.to_dict()))) == sp
    assert Constraint.from_value(sp.constraint.to_dict()) == want


def test_no_constraint_is_none():
    sp = SamplingParams(**sampling_kwargs(build_request(prompt_token_ids=[1]).sampling))
    assert sp.constraint is None
    assert constraint_kwargs(pb.Constraint())["kind"] == ""
