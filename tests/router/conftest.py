"""Router tests: the router in process against fake nodes (real gRPC servers on loopback)."""

from __future__ import annotations

import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.front_door import start
from tests.helpers.serve_harness import SPEC


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A tiny Qwen3.5 checkpoint with a tokenizer (the serving tests' own)."""
    return hc.make(tmp_path_factory.mktemp("router") / "ckpt", SPEC)


@pytest.fixture(scope="module")
def hf(ckpt):
    """transformers' tokenizer of `ckpt`: the reference for rendered chats and calls."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def front(ckpt):
    """The router's chat front of `ckpt` (rendering, tool grammars, output parsers)."""
    from engine.tokenizer import Tokenizer
    from router.openai_chat import ChatFront

    return ChatFront(Tokenizer(ckpt))


@pytest.fixture(scope="module")
def door(ckpt):
    """The front door (tests/helpers/front_door.py), one per test module."""
    r, fake, srv, hb, port = start(ckpt, dead_after_s=3.0, max_queued_requests=64)
    yield r, fake, port
    hb.stop()
    r.stop(0)
    srv.stop(0)
