from __future__ import annotations

import pytest

from engine.tiny_model import TinyModelSpec, make_tiny_model

SPEC = TinyModelSpec(layers=4, seed=0)  # with its byte-level BPE tokenizer (1,024 ids)


@pytest.fixture(scope="session")
def tok_ckpt(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("structured") / "ckpt", SPEC))


@pytest.fixture(scope="session")
def llm(tok_ckpt):
    from engine import LLM

    llm = LLM(tok_ckpt, dtype="float32")
    yield llm
    llm.close()
