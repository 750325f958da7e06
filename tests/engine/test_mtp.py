"""MTP speculative decoding from the checkpoint's own `mtp.*` block: the block's draft logits
against a reference built from transformers' modules, tokens identical to transformers'
greedy output for k = 1, 2, 3 (TP 1 and 2), rows near max_model_len beside drafting rows.

The checkpoint's block is fitted to the model's greedy continuations of the 1- and 40-token
prompts, so their drafts are mostly accepted (the accept paths of verification, at every draft
position, and near max_model_len) while the 5-token prompt's are mostly rejected (rollback),
in the same batches."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cache.allocator import kv_pool_view
from engine.config import EngineArgs
from engine.loader import load_mtp_weights, load_weights
from engine.model.mtp import MTPBlock, mtp_batch
from engine.model.qwen3_5 import Qwen35Model
from tests.helpers import hybrid_ckpt as hc

NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
# the fixtures ckpt_mtp and mtp_prompts (lengths 1, 5, 40) are in conftest.py


def _drafts_accepted_and_rejected(s) -> None:
    """Drafts were accepted at every position (accept paths) and some were rejected (rollback)."""
    assert all(a > 0 for a in s.accepted_per_position), (s.drafts_per_position, s.accepted_per_position)
    assert sum(s.accepted_per_position) < sum(s.drafts_per_position)


@pytest.fixture(scope="module")
def hf_ref_mtp(ckpt_mtp, mtp_prompts):
    return [hc.hf_greedy(ckpt_mtp, p, NEW) for p in mtp_prompts]


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_mtp_block_logits_match_transformers_modules(ckpt_mtp):
    cfg = EngineArgs(ckpt_mtp, dtype="float32").engine_config().model
    w = load_weights(cfg, 1, 0)
    model = Qwen35Model(cfg, w, 1, lambda x: x, 128, "cpu")
    block = MTPBlock(cfg, load_mtp_weights(cfg, 1, 0), model.embed, model.lm_head, 1, lambda x: x)
    tokens = hc.prompts(lens=(33,), seed=5)[0]
    ref_logits, ref_out = hc.hf_mtp_logits(ckpt_mtp, tokens)
    n = len(tokens) - 1
    bs = 16
    kv = {cfg.num_layers: kv_pool_view(torch.zeros(cfg.num_kv_heads, 8, 2, bs, cfg.head_dim))}
    blocks = [5, 2, 7, 0]  # out of order on purpose
    hidden = hc._hf_model(ckpt_mtp).model(torch.tensor([tokens])).last_hidden_state[0, :-1]
    batch = mtp_batch([(0, n, blocks)], bs, "cpu")
    cos, sin = model.rotary(batch.positions)
    with torch.inference_mode():
        out = block(torch.tensor(tokens[1:]), hidden, batch, kv, cos, sin)
        logits = block.logits(out)
    assert _rel(logits, ref_logits) < 1e-4
    # a recursive step: (the block's own output, its draft) at the next position, over the KV above
    d1 = int(logits[-1].argmax())
    ref2, _ = hc.hf_mtp_logits(ckpt_mtp, tokens, [(d1, ref_out[-1])])
    batch = mtp_batch([(n, 1, blocks)], bs, "cpu")
    cos, sin = model.rotary(batch.positions)
    with torch.inference_mode():
        l2 = block.logits(block(torch.tensor([d1]), out[-1:], batch, kv, cos, sin))
    assert _rel(l2[0], ref2[-1]) < 1e-4


def test_engine_drafts_are_the_blocks_argmax(ckpt_mtp):
    """The drafts left after a prompt's prefill are the reference block's greedy chain."""
    prompt = hc.prompts(lens=(21,), seed=6)[0]
    with LLM(ckpt_mtp, dtype="float32", speculative_method="mtp", num_speculative_tokens=2) as llm:
        first, drafts = hc.first_step_drafts(llm, prompt, GREEDY)
    logits, out = hc.hf_mtp_logits(ckpt_mtp, prompt + [first])
    d1 = int(logits[-1].argmax())
    l2, _ = hc.hf_mtp_logits(ckpt_mtp, prompt + [first], [(d1, out[-1])])
    assert drafts == [d1, int(l2[-1].argmax())]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_matches_transformers(ckpt_mtp, mtp_prompts, hf_ref_mtp, k):
    with LLM(ckpt_mtp, dtype="float32", speculative_method="mtp", num_speculative_tokens=k) as llm:
        outs = llm.generate(prompt_token_ids=mtp_prompts, sampling_params=GREEDY)
        assert [o.output_token_ids for o in outs] == hf_ref_mtp
        s = llm.engine.scheduler
        assert s.num_draft_tokens > 0 and len(s.drafts_per_position) == k
        _drafts_accepted_and_rejected(s)
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks
        assert llm.engine.slots.num_free == llm.capacity().num_state_slots


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_matches_transformers_tp2(ckpt_mtp, mtp_prompts, hf_ref_mtp, k):
    with LLM(
        ckpt_mtp, dtype="float32", speculative_method="mtp", num_speculative_tokens=k, tensor_parallel_size=2
    ) as llm:
        outs = llm.generate(prompt_token_ids=mtp_prompts, sampling_params=GREEDY)
        _drafts_accepted_and_rejected(llm.engine.scheduler)
    assert [o.output_token_ids for o in outs] == hf_ref_mtp


def test_request_caps_its_draft_depth(ckpt_mtp, mtp_prompts, hf_ref_mtp):
    """num_speculative_tokens per request: 1 and 0 under an engine at k = 3 keep transformers'
    tokens, with no drafts past position 1 (or none at all); above k, or negative, is refused."""
    with LLM(ckpt_mtp, dtype="float32", speculative_method="mtp", num_speculative_tokens=3) as llm:
        s = llm.engine.scheduler
        outs = llm.generate(prompt_token_ids=mtp_prompts, sampling_params=replace(GREEDY, num_speculative_tokens=1))
        assert [o.output_token_ids for o in outs] == hf_ref_mtp
        assert s.drafts_per_position[0] > 0 and s.drafts_per_position[1:] == [0, 0]
        seen = s.num_draft_tokens
        outs = llm.generate(prompt_token_ids=mtp_prompts, sampling_params=replace(GREEDY, num_speculative_tokens=0))
        assert [o.output_token_ids for o in outs] == hf_ref_mtp and s.num_draft_tokens == seen
        with pytest.raises(ValueError, match="num_speculative_tokens 4 exceeds this server's 3"):
            llm.generate(prompt_token_ids=mtp_prompts[:1], sampling_params=replace(GREEDY, num_speculative_tokens=4))
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks
    with pytest.raises(ValueError, match="num_speculative_tokens must be a non-negative integer"):
        SamplingParams(num_speculative_tokens=-1)


def test_row_reaches_max_model_len_while_others_draft(ckpt_mtp, mtp_prompts, hf_ref_mtp):
    """max_model_len = 48: the 40-token prompt stops after 8 tokens (its last rows carry fewer
    drafts, then none) while the short prompts keep drafting; same tokens, nothing leaks."""
    with LLM(ckpt_mtp, dtype="float32", speculative_method="mtp", num_speculative_tokens=3, max_model_len=48) as llm:
        outs = llm.generate(prompt_token_ids=mtp_prompts, sampling_params=GREEDY)
        assert outs[2].finish_reason == "length" and len(outs[2].output_token_ids) == 48 - 40
        assert outs[2].output_token_ids == hf_ref_mtp[2][:8]
        assert [o.output_token_ids for o in outs[:2]] == hf_ref_mtp[:2]
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks


def test_mtp_capacity_counts_the_drafters_pages(ckpt_mtp):
    with (
        LLM(ckpt_mtp, dtype="float32", kv_cache_memory="64MiB", max_num_seqs=4) as plain,
        LLM(
            ckpt_mtp,
            dtype="float32",
            kv_cache_memory="64MiB",
            max_num_seqs=4,
            speculative_method="mtp",
            num_speculative_tokens=2,
        ) as spec,
    ):
        a, b = plain.capacity(), spec.capacity()
    cfg = EngineArgs(ckpt_mtp).engine_config().model
    per_layer = a.kv_bytes_per_token // len(cfg.attention_layers)
    assert b.kv_bytes_per_token == a.kv_bytes_per_token + per_layer
    assert b.num_blocks < a.num_blocks


def test_mtp_without_mtp_weights_fails_in_one_line(ckpt_hv2):
    with pytest.raises(ValueError) as e:
        LLM(ckpt_hv2, dtype="float32", speculative_method="mtp", num_speculative_tokens=2)
    assert "mtp" in str(e.value) and "\n" not in str(e.value)


def _scheduler(k: int, **spec):
    from engine.cache.block_manager import BlockManager, SlotPool
    from engine.config import SchedulerConfig, SpeculativeConfig
    from engine.scheduler import Scheduler

    cfg = SpeculativeConfig(num_tokens=k, method="mtp", **spec)
    return Scheduler(SchedulerConfig(), BlockManager(8, 16), SlotPool(2), 128, k, None, cfg)


def test_depth_control_lowers_and_restores_a_requests_draft_depth():
    """Exponential average (weight 0.5) of the accepted fraction: under 0.3 the depth drops by
    one, over 0.6 it climbs by one (not above k); counters per draft position. With draft_cost 0
    a draft always pays, so the depth never goes under 1."""
    from engine.request import Request

    s = _scheduler(3, draft_cost=0.0)
    req = Request("r", [1, 2, 3], GREEDY)
    s.add(req)
    assert req.spec.depth == 3
    depths = []
    for _ in range(4):  # nothing accepted: 1.0 -> 0.5 -> 0.25 (drop) -> 0.125 (drop) -> ...
        s._record(req, req.spec.depth, 0)
        depths.append(req.spec.depth)
    assert depths == [3, 2, 1, 1]
    for _ in range(3):  # all accepted: 0.56 -> 0.78 (raise) -> 0.89 (raise)
        s._record(req, req.spec.depth, req.spec.depth)
        depths.append(req.spec.depth)
    assert depths[4:] == [1, 2, 3]
    assert s.drafts_per_position == [7, 4, 2] and s.accepted_per_position == [3, 1, 0]


def test_depth_drops_to_zero_and_probes_with_a_growing_wait():
    """Two rejected first drafts in a row (average 0.25 < draft_cost 0.5): depth 0 from any depth.
    Then a probe (depth 1) after 2, 4, 8, 8 plain steps (interval 2, doubling, capped at 8) while
    probes fail; a passed probe keeps depth 1, and the depth climbs again from there."""
    from engine.request import Request

    s = _scheduler(3, probe_interval=2, probe_max=8)
    req = Request("r", [1, 2, 3], GREEDY)
    s.add(req)
    s._record(req, 3, 0)
    assert req.spec.depth == 3
    s._record(req, 3, 0)
    assert req.spec.depth == 0
    waits = []
    for _ in range(4):
        n = 0
        while req.spec.depth == 0:
            s._tick(req)
            n += 1
        waits.append(n)
        assert req.spec.depth == 1
        s._tick(req)  # the probe's drafting step carries no drafts yet: no effect
        s._record(req, 1, 0)  # the probe fails
        assert req.spec.depth == 0
    assert waits == [2, 4, 8, 8]
    while req.spec.depth == 0:
        s._tick(req)
    s._record(req, 1, 1)  # passed: back to drafting, one draft
    assert req.spec.depth == 1
    s._record(req, 1, 1)
    s._record(req, 2, 2)
    assert req.spec.depth == 3
    # a request that may not speculate (num_speculative_tokens 0) never probes
    other = Request("o", [1], SamplingParams(max_tokens=4, num_speculative_tokens=0))
    s.add(other)
    for _ in range(20):
        s._tick(other)
    assert other.spec.depth == 0
    assert s.drafts_per_position == [9, 3, 2] and s.accepted_per_position == [3, 1, 0]


def _traced(llm):
    """Run the engine's requests to the end, recording each request's depth after every step and
    counting drafted / accepted tokens per draft position from the rows and emitted tokens."""
    s = llm.engine.scheduler
    depths: dict[int, list[int]] = {}
    drafted, accepted = [0] * s.num_spec_tokens, [0] * s.num_spec_tokens
    update = s.update

    def spy(out, sampled, eos, drafts=None):
        for row in out.rows:
            toks = sampled.get(row.request.request_id, [])
            for j in range(len(row.draft_token_ids)):
                drafted[j] += 1
                accepted[j] += all(row.draft_token_ids[i] == toks[i] for i in range(j + 1))
        return update(out, sampled, eos, drafts)

    s.update = spy
    reqs = list(llm.engine.requests.values())
    while llm.engine.has_unfinished():
        llm.engine.step()
        for r in reqs:
            depths.setdefault(len(r.prompt_token_ids), []).append(r.spec.depth)
    return depths, drafted, accepted


def _tight_probes(llm, max_pending: int):
    s = llm.engine.scheduler
    s.spec = replace(s.spec, probe_interval=1, probe_max=4)
    llm.engine.executor.worker.drafter.max_pending = max_pending


def test_depth_zero_beside_drafting_rows_matches_transformers(ckpt_mtp, mtp_prompts, hf_ref_mtp):
    """The unfitted 5-token prompt stops drafting and probes again while the fitted ones draft, in
    the same batches; its deferred MTP fills (flushed every 3 positions or at a probe) keep the
    tokens transformers' and the per-position counters those of the rows."""
    with LLM(ckpt_mtp, dtype="float32", speculative_method="mtp", num_speculative_tokens=2) as llm:
        _tight_probes(llm, 3)
        reqs = [llm.engine.requests[llm.engine.add_request(p, GREEDY)] for p in mtp_prompts]
        s = llm.engine.scheduler
        depths, drafted, accepted = _traced(llm)
        assert [r.output_token_ids for r in reqs] == hf_ref_mtp
        assert (s.drafts_per_position, s.accepted_per_position) == (drafted, accepted)
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks
        # deferred fills of finished requests go when the workers next hear of finished requests
        llm.generate(prompt_token_ids=[[7]], sampling_params=SamplingParams(max_tokens=1))
        assert not llm.engine.executor.worker.drafter.pending
    trace = "".join(map(str, depths[5]))
    assert "0" in trace and "01" in trace, trace  # stopped, then probed
    assert "0" not in "".join(map(str, depths[40]))


def _mtp_kv_after(llm, prompt, pause: int) -> tuple[list[int], torch.Tensor]:
    """Generate with the request held at depth 0 for its first `pause` steps: its tokens, and the
    MTP block's KV [positions, 2, KVH, hd] over every position whose next token is known."""
    rid = llm.engine.add_request(prompt, GREEDY)
    req = llm.engine.requests[rid]
    req.spec = replace(req.spec, depth=0, wait=pause) if pause else replace(req.spec, wait=0)
    blocks = []
    while llm.engine.has_unfinished():
        blocks = list(req.block_ids) or blocks
        llm.engine.step()
    pool = llm.engine.executor.worker.pools.kv[llm.config.model.num_layers]  # [blocks, 2, KVH, bs, hd]
    n = len(prompt) + len(req.output_token_ids) - 1
    kv = torch.cat([pool[b] for b in blocks], dim=2)[:, :, :n].permute(2, 0, 1, 3)
    return req.output_token_ids, kv.clone()


def test_paused_request_drafts_again_from_an_up_to_date_mtp_kv(ckpt_mtp, mtp_prompts, hf_ref_mtp):
    """A fitted request held at depth 0 for its first steps (MTP fills deferred, flushed every 3
    positions and at the probe) probes, passes and climbs back to k: its tokens are transformers',
    its MTP KV over the whole sequence is that of a run that never stopped drafting, and the
    drafts it makes after are the reference block's argmax."""
    prompt = mtp_prompts[2]
    with LLM(ckpt_mtp, dtype="float32", speculative_method="mtp", num_speculative_tokens=2) as llm:
        ref_out, ref_kv = _mtp_kv_after(llm, prompt, 0)
        _tight_probes(llm, 3)
        rid = llm.engine.add_request(prompt, GREEDY)
        req = llm.engine.requests[rid]
        req.spec = replace(req.spec, depth=0, wait=5)
        seen = []  # (tokens so far, the first draft for the next step) once drafting again
        depths = []
        while llm.engine.has_unfinished():
            llm.engine.step()
            depths.append(req.spec.depth)
            if req.draft_token_ids and req.status.value == "running":
                seen.append((prompt + req.output_token_ids, req.draft_token_ids[0]))
        out, kv = _mtp_kv_after(llm, prompt, 8)
    assert req.output_token_ids == out == ref_out == hf_ref_mtp[2]
    assert depths[:4] == [0, 0, 0, 0] and depths[-1] == 2, depths
    assert _rel(kv, ref_kv) < 1e-5
    assert len(seen) >= 3
    logits, _ = hc.hf_mtp_logits(ckpt_mtp, seen[-1][0])
    for toks, d in seen:
        assert int(logits[len(toks) - 2].argmax()) == d  # position p pairs h_p with token p + 1
