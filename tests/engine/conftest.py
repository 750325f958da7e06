from __future__ import annotations

import hybrid_ckpt as hc
import pytest


@pytest.fixture(scope="session")
def ckpt_hv2(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("hv2") / "ckpt", hc.SPEC_HV2)


@pytest.fixture(scope="session")
def ckpt_hv1(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("hv1") / "ckpt", hc.SPEC_HV1)


@pytest.fixture(scope="session")
def prompts():
    return hc.prompts()


@pytest.fixture(scope="session")
def hf_ref_hv2(ckpt_hv2, prompts):
    return [hc.hf_greedy(ckpt_hv2, p, 48) for p in prompts]


@pytest.fixture(scope="session")
def hf_ref_hv1(ckpt_hv1, prompts):
    return [hc.hf_greedy(ckpt_hv1, p, 48) for p in prompts]


@pytest.fixture(scope="session")
def llm_hv2(ckpt_hv2):
    from engine import LLM

    llm = LLM(ckpt_hv2, dtype="float32")
    yield llm
    llm.close()
