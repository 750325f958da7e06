"""What a step hands back per request (engine/outputs.py): new tokens add up to the final output;
a running request's output_token_ids is its growing list (no copy a step), a finished one's a
list of its own."""

from __future__ import annotations

from engine.sampling_params import SamplingParams


def test_new_tokens_add_up_and_the_final_list_is_its_own(llm_hv2):
    e = llm_hv2.engine
    rid = e.add_request([5, 17, 300, 42], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    outs = []
    while e.has_unfinished():
        outs += [o for o in e.step() if o.request_id == rid]
    final = outs[-1]
    assert final.finished and [o.finished for o in outs[:-1]] == [False] * (len(outs) - 1)
    assert [t for o in outs for t in o.new_token_ids] == final.output_token_ids and len(final.output_token_ids) == 6
    assert all(o.output_token_ids is not final.output_token_ids for o in outs[:-1])
    assert all(o.output_token_ids == final.output_token_ids for o in outs[:-1])  # the list they shared grew
