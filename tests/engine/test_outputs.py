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


def test_each_end_carries_the_count_of_ends_the_node_reports(llm_hv2):
    """A finished (or aborted) request's last output carries the scheduler's count of ended
    requests once it ended (metrics["ended"], the decode node's node_ended), and the capacity
    snapshot reports the same count (NodeInfo.requests_ended): a report counts an end iff its count is at
    least the end's."""
    from serving.commands import Snapshot, take_snapshot

    e = llm_hv2.engine
    before = e.scheduler.ended_total
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    short = e.add_request([5, 17, 300], sp)
    long = e.add_request([7, 8, 9], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    gone = e.add_request([1, 2, 3], sp)
    aborted = e.abort(gone)
    assert aborted is not None and aborted.finished
    ends, running = {gone: aborted.metrics["ended"]}, []
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                ends[o.request_id] = o.metrics["ended"]
            elif o.request_id == long:
                running.append(o.metrics.get("ended"))
    assert sorted(ends.values()) == [before + 1, before + 2, before + 3]
    assert ends[gone] < ends[short] < ends[long] and running and set(running) == {None}
    assert take_snapshot(e, Snapshot()).ended == e.scheduler.ended_total == before + 3


def test_the_reported_queue_is_net_of_the_prefix_hits_the_waiting_will_get(llm_hv2):
    """The queued prompt tokens a node reports (what the router prices it by) count each waiting
    request's prompt less the cached prefix it starts from, as the router counts what it sent:
    three prompts sharing a cached 200-token prefix queue their new tokens, not 3 x 220. The
    reference is the hit each got at its admission."""
    from serving.commands import Snapshot, take_snapshot

    e = llm_hv2.engine
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefix = [(7 * i + 3) % 500 + 10 for i in range(200)]
    e.add_request(prefix, sp)
    while e.has_unfinished():
        e.step()
    rids = [e.add_request(prefix + [20 + k] * 20, sp) for k in range(3)]
    reqs = [e.requests[r] for r in rids]
    queued = take_snapshot(e, Snapshot()).queued_prefill_tokens
    while e.has_unfinished():
        e.step()
    hits = [r.num_cached_tokens for r in reqs]
    assert min(hits) > 0, hits  # the prefix was taken from the cache
    assert queued == sum(220 - h for h in hits), (queued, hits)


def test_evictions_are_counted_for_the_metrics(ckpt_hv2):
    """More prompts than the cache holds: its pages and snapshots are handed out again, and the
    node's snapshot (its /metrics) counts both, never fewer than what cannot fit."""
    from engine import LLM
    from serving.commands import Snapshot, take_snapshot
    from serving.metrics import capacity_gauges

    with LLM(ckpt_hv2, dtype="float32", kv_cache_memory="20MiB", max_num_seqs=4, engine_process=False) as llm:
        e = llm.engine
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        pages, bs = 0, e.capacity.block_size
        for k in range(150):
            prompt = [(k * 37 + 11 * i) % 900 + 5 for i in range(300)]
            llm.generate(prompt_token_ids=[prompt], sampling_params=sp)
            pages += 300 // bs
            if pages > 2 * e.capacity.num_blocks and e.scheduler.plan.prefix.stats.saved > 2 * e.capacity.num_snapshots:
                break
        snap = take_snapshot(e, Snapshot())
        saved = e.scheduler.plan.prefix.stats.saved
    assert pages > 2 * snap.total_blocks and saved > 2 * snap.prefix_snapshots, (pages, saved)
    assert snap.prefix_pages_evicted >= pages - snap.total_blocks > 0
    assert snap.prefix_snapshots_evicted >= saved - snap.prefix_snapshots > 0
    g = capacity_gauges(snap)
    assert g["prefix_pages_evicted_total"][1] == snap.prefix_pages_evicted
    assert g["prefix_snapshots_evicted_total"][1] == snap.prefix_snapshots_evicted
