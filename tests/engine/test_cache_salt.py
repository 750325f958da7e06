"""`cache_salt` in the engine (docs/prefix-caching.md): a request shares cached pages and GDN
snapshots only with requests of the same salt, an unsalted one only with unsalted ones; the
tokens are transformers' greedy whichever way the state was found, and nothing is held after."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.prefix_hash import salted
from tests.helpers import hybrid_ckpt as hc


def _params(salt: str = "") -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, cache_salt=salt)


def test_a_salt_shares_only_with_its_own(ckpt_hv2):
    g = torch.Generator().manual_seed(17)
    base = torch.randint(0, 1024, (70,), generator=g).tolist()
    turn = base + torch.randint(0, 1024, (9,), generator=g).tolist()
    # (prompt, salt, prompt tokens expected from the cache), run in this order
    runs = [
        (base, "tenant-a", 0),
        (turn, "tenant-b", 0),  # tenant a's pages and snapshots are not b's
        (turn, "", 0),  # nor an unsalted request's
        (turn, "tenant-a", 70),  # a's own: resumes at its end-of-prompt snapshot
        # the unsalted run of `turn` left its grid snapshot at 64 for unsalted requests ...
        (base + [5, 6, 7], "", 64),
        (base, "tenant-b", 64),  # ... and b's run of it, for b's
    ]
    with LLM(ckpt_hv2, dtype="float32", prefix_snapshot_interval=32) as llm:
        outs = [llm.generate(prompt_token_ids=[p], sampling_params=_params(s))[0] for p, s, _ in runs]
        e = llm.engine
        assert (e.blocks.num_free, e.slots.num_free) == (llm.capacity().num_blocks, llm.capacity().num_state_slots)
        assert not e.blocks.ref and all(s.ref == 0 for s in e.prefix._by_key.values())
    assert [o.num_cached_tokens for o in outs] == [n for _, _, n in runs]
    for (p, _, _), o in zip(runs, outs):
        assert o.output_token_ids == hc.hf_greedy(ckpt_hv2, p, 8)


def test_salted_names_differ_and_equal_salts_agree():
    ids = list(range(40))
    a, a2, b = salted(ids, "a"), salted(list(ids), "a"), salted(ids, "b")
    assert a == a2 and a != b and a[1:] == ids[1:] and a[0] != ids[0]
    assert salted(ids, "") is ids
    assert all(0 < x[0] < 2**63 for x in (a, b))


@pytest.mark.parametrize("salt", [3, "x" * 1025])
def test_bad_salt_is_refused(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt=salt)
