from __future__ import annotations

import pytest

from tests.helpers import hybrid_ckpt as hc


@pytest.fixture(scope="session")
def ckpt_hv2(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("hv2") / "ckpt", hc.SPEC_HV2)


@pytest.fixture(scope="session")
def ckpt_hv1(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("hv1") / "ckpt", hc.SPEC_HV1)


@pytest.fixture(scope="session")
def ckpt_bf16(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("bf16") / "ckpt", hc.SPEC_BF16)


@pytest.fixture(scope="session")
def ckpt_moe(tmp_path_factory):
    """Qwen3.5-MoE's tiny checkpoint (hc.SPEC_MOE)."""
    return hc.make(tmp_path_factory.mktemp("moe35") / "ckpt", hc.SPEC_MOE["qwen3_5_moe"])


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


@pytest.fixture(scope="session")
def mtp_prompts():
    """Prompts of 1, 5 and 40 tokens for the MTP tests."""
    return hc.prompts(lens=(1, 5, 40), seed=3)


@pytest.fixture(scope="session")
def ckpt_mtp(tmp_path_factory, mtp_prompts):
    """A checkpoint with an MTP block fitted to the 1- and 40-token prompts' greedy continuations."""
    return hc.make_fitted_mtp(tmp_path_factory.mktemp("mtp") / "ckpt", hc.SPEC_MTP, mtp_prompts[::2])


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory):
    """moe_ckpt(arch): the tiny MoE checkpoint of that architecture, made on first use."""
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = hc.make(tmp_path_factory.mktemp(arch) / "ckpt", hc.SPEC_MOE[arch])
        return made[arch]

    return get


@pytest.fixture(scope="session")
def moe_prompts():
    return hc.prompts(320, hc.MOE_PROMPT_LENS, seed=5)
