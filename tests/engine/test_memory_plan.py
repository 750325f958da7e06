"""The cache budget planned from the device (--gpu-memory-utilization): the plan against sizes
computed by hand, the option on each device, the worker's planned path on the CPU with fixed
figures, and the real path on CUDA."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.cache import build_specs
from engine.cache.memory_plan import DeviceFacts, plan_memory
from engine.config import CacheConfig, EngineArgs, EngineConfig, SchedulerConfig
from engine.device_defaults import budget_source
from engine.memory_profile import outside_bytes, own_device_bytes
from engine.options import options
from engine.sampling_params import SamplingParams
from tests.engine.test_cache import model_cfg

GiB, MiB = 2**30, 2**20
# model_cfg(): 6 GDN layers of conv 512 x 3 bf16 + recurrent 8 x 32 x 32 float32; 2 attention
# layers of K + V, 2 heads x 64, 16 tokens a page, bf16
SLOT = 6 * (512 * 3 * 2 + 8 * 32 * 32 * 4)
PAGE = 2 * (2 * 2 * 64 * 16 * 2)
SNAPSHOT = SLOT + PAGE  # every GDN state + one partial page per attention layer
FACTS = DeviceFacts(total=8 * GiB, free_at_start=8 * GiB, weights=1 * GiB, peak=512 * MiB)


def specs():
    return build_specs(EngineConfig(model_cfg(), cache=CacheConfig(block_size=16)), 0)


def test_fraction_less_weights_and_peak():
    plan = plan_memory(FACTS, 0.5, specs(), 10, 16)
    budget = 4 * GiB - 1 * GiB - 512 * MiB
    assert plan.budget == budget and not plan.explicit
    c = plan.capacity
    assert (c.num_state_slots, c.state_bytes) == (10, 10 * SLOT)
    assert c.num_blocks == (budget - 10 * SLOT) // PAGE
    assert c.num_blocks * PAGE + 10 * SLOT <= budget < (c.num_blocks + 1) * PAGE + 10 * SLOT
    line = plan.summary()
    for part in ("weights 1.00 GiB", "profile peak 512.0 MiB", f"{c.num_blocks} KV pages", "10 GDN state slots"):
        assert part in line


def test_padded_decode_graphs_are_planned():
    """CUDA graphs padded to buckets: the graphs' logits (B x vocabulary float32, per size) come
    off the budget, and the padding slot and page out of it (each as computed by hand)."""
    import dataclasses

    from engine.model.graphs import decode_buckets, logits_bytes

    buckets = decode_buckets(64)
    graphs = 4 * 151936 * sum(buckets)
    assert logits_bytes(buckets, 151936) == graphs == 4 * 151936 * (1 + 2 + 4 + 8 * 36)
    plan = plan_memory(dataclasses.replace(FACTS, graphs=graphs), 0.5, specs(), 10, 16, padding=1)
    budget = 4 * GiB - 1 * GiB - 512 * MiB - graphs
    assert plan.budget == budget and f"decode graphs {graphs / MiB:.1f} MiB" in plan.summary()
    c = plan.capacity
    assert c.padding == 1 and c.num_blocks == (budget - 11 * SLOT - PAGE) // PAGE


def test_another_process_holding_memory_leaves_the_share_alone_or_refuses():
    """The fraction is this instance's share, as in vLLM: a share that fits in what was free at
    start is planned whole (less this instance's own weights, peak and outside); one that does not
    is refused, naming what was free."""
    facts = DeviceFacts(total=8 * GiB, free_at_start=5 * GiB, weights=1 * GiB, peak=512 * MiB, outside=256 * MiB)
    assert facts.others == 3 * GiB
    plan = plan_memory(facts, 0.5, specs(), 10, 16)
    assert plan.budget == 4 * GiB - 1 * GiB - 512 * MiB - 256 * MiB
    assert "other processes 3.00 GiB" in plan.summary() and "outside PyTorch 256.0 MiB" in plan.summary()
    with pytest.raises(ValueError, match=r"asks for 7.20 GiB .* only 5.00 GiB was free at start"):
        plan_memory(facts, 0.9, specs(), 10, 16)


def test_tensor_parallel_ranks_take_the_smallest_budget():
    """A rank with more memory left plans with the agreed (smallest) budget, and refuses like the
    others, saying why, when the smallest is nothing."""
    plan = plan_memory(FACTS, 0.5, specs(), 10, 16, agreed=1 * GiB)
    assert plan.budget == 1 * GiB and plan.capacity.num_blocks == (1 * GiB - 10 * SLOT) // PAGE
    assert plan_memory(FACTS, 0.5, specs(), 10, 16, agreed=3 * GiB).budget == 4 * GiB - 1 * GiB - 512 * MiB
    with pytest.raises(ValueError, match=r"another tensor-parallel rank has only 0.0 MiB for its cache\)"):
        plan_memory(FACTS, 0.5, specs(), 10, 16, agreed=-5)


def test_speculative_scratch_and_snapshots_are_counted():
    plan = plan_memory(FACTS, 0.5, specs(), 10, 16, num_spec_tokens=2, snapshot_fraction=0.1)
    budget = 4 * GiB - 1 * GiB - 512 * MiB
    c = plan.capacity
    scratch = 10 * 3 * SLOT  # the state after each of k + 1 = 3 verified tokens, per slot
    snaps = int(budget * 0.1) // SNAPSHOT
    assert (c.spec_scratch_bytes, c.num_snapshots, c.snapshot_bytes) == (scratch, snaps, snaps * SNAPSHOT)
    assert c.num_blocks == (budget - 10 * SLOT - scratch - snaps * SNAPSHOT) // PAGE
    assert f"speculative scratch {scratch / MiB:.1f} MiB" in plan.summary()


def test_nothing_left_names_the_fraction_and_the_sizes():
    with pytest.raises(ValueError) as e:
        plan_memory(FACTS, 0.1, specs(), 10, 16)
    msg = str(e.value)
    for part in ("--gpu-memory-utilization 0.1", "weights 1.00 GiB", "profile peak 512.0 MiB", "of 8.00 GiB"):
        assert part in msg
    assert "raise --gpu-memory-utilization" in msg
    # a budget left, but under the slots it must hold
    tight = DeviceFacts(total=8 * GiB, free_at_start=8 * GiB, weights=1 * GiB, peak=int(0.5 * 8 * GiB) - GiB - MiB)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0.5 leaves a cache of 1.0 MiB .* too small"):
        plan_memory(tight, 0.5, specs(), 10, 16)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        plan_memory(FACTS, 1.5, specs(), 10, 16)


def test_explicit_kv_cache_memory_wins():
    plan = plan_memory(FACTS, 0.9, specs(), 10, 16, kv_cache_memory=64 * MiB)
    assert plan.explicit and plan.budget == 64 * MiB
    assert plan.capacity.num_blocks == (64 * MiB - 10 * SLOT) // PAGE
    assert "(--kv-cache-memory)" in plan.summary()
    with pytest.raises(ValueError, match=r"--kv-cache-memory 7.00 GiB does not fit: the device has 6.50 GiB left"):
        plan_memory(FACTS, 0.9, specs(), 10, 16, kv_cache_memory=7 * GiB)


def test_the_option_on_each_device(caplog, monkeypatch):
    assert "gpu_memory_utilization" in {o.name for o in options(EngineArgs)}
    monkeypatch.delenv("PDSERVE_GPU_MEMORY_UTILIZATION", raising=False)
    assert budget_source(None, None, "cuda") == (None, 0.9)
    assert budget_source(None, 0.6, "cuda:0,1") == (None, 0.6)
    assert budget_source("2GiB", None, "cuda") == ("2GiB", 0.9)  # given: it wins (the plan still checks it fits)
    assert budget_source(None, None, "cpu") == ("256MiB", None)
    with caplog.at_level(logging.WARNING, logger="pdserve.config"):
        assert budget_source("1GiB", 0.5, "cpu") == ("1GiB", None)
    assert "--gpu-memory-utilization 0.5 is ignored on cpu" in caplog.text
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\] \(got 0.0\)"):
        budget_source(None, 0.0, "cuda")
    with pytest.raises(ValueError, match="kv_cache_memory must be positive"):
        CacheConfig(kv_cache_memory=None)


def test_the_environment_sets_the_default_share(monkeypatch):
    """Engines sharing a GPU (parallel test workers) take PDSERVE_GPU_MEMORY_UTILIZATION where no
    flag names a share; a flag wins, the CPU ignores it, a bad value is refused naming it."""
    monkeypatch.setenv("PDSERVE_GPU_MEMORY_UTILIZATION", "0.25")
    assert budget_source(None, None, "cuda") == (None, 0.25)
    assert budget_source(None, 0.6, "cuda") == (None, 0.6)
    assert budget_source(None, None, "cpu") == ("256MiB", None)
    monkeypatch.setenv("PDSERVE_GPU_MEMORY_UTILIZATION", "lots")
    with pytest.raises(ValueError, match="PDSERVE_GPU_MEMORY_UTILIZATION='lots' is not a number"):
        budget_source(None, None, "cuda")
    monkeypatch.setenv("PDSERVE_GPU_MEMORY_UTILIZATION", "1.5")
    with pytest.raises(ValueError, match=r"\(got 1.5\)"):
        budget_source(None, None, "cuda")


def test_outside_memory_counts_this_process_where_the_driver_tells():
    """Another engine starting beside this one takes 8 GiB while this one loads: with this
    process's own readings that is not this engine's; with the device's alone it would be."""
    total, free_start, free_now, reserved = 80 * GiB, 70 * GiB, 60 * GiB - 512 * MiB, 1 * GiB + 512 * MiB
    assert outside_bytes(total, free_start, free_now, 600 * MiB, 600 * MiB + 2 * GiB, reserved) == 512 * MiB
    assert outside_bytes(total, free_start, free_now, None, None, reserved) == 9 * GiB
    assert outside_bytes(total, free_start, free_start, 0, 100 * MiB, reserved) == 0  # never below zero


def test_no_nvml_reading_without_cuda():
    assert own_device_bytes(torch.device("cpu")) is None


def test_cpu_args_keep_the_fixed_budget(ckpt_hv2):
    cfg = EngineArgs(ckpt_hv2, gpu_memory_utilization=0.5).engine_config()
    assert (cfg.cache.kv_cache_memory, cfg.cache.gpu_memory_utilization) == ("256MiB", None)


class FakeProbe:
    """Fixed figures in place of a device's: the CPU cannot measure one. Records the calls' order."""

    def __init__(self, facts: DeviceFacts):
        self._facts = facts
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")

    def loaded(self) -> None:
        self.calls.append("loaded")

    def stepping(self) -> None:
        self.calls.append("stepping")

    def facts(self) -> DeviceFacts:
        self.calls.append("facts")
        return self._facts


@pytest.mark.parametrize("k", [0, 2])
def test_worker_plans_from_the_probe(ckpt_hv2, prompts, hf_ref_hv2, monkeypatch, k):
    """The planned path on the CPU: the profile steps run (sampling rows, and drafts to verify), the
    pools are sized from the probe's figures, and generation still matches transformers."""
    import engine.worker
    from engine.core import EngineCore

    probe = FakeProbe(DeviceFacts(total=2 * GiB, free_at_start=2 * GiB, weights=256 * MiB, peak=64 * MiB))
    monkeypatch.setattr(engine.worker, "CudaProbe", lambda device: probe)
    base = EngineArgs(ckpt_hv2, dtype="float32", max_num_seqs=8, num_speculative_tokens=k).engine_config()
    cfg = EngineConfig(
        base.model,
        cache=CacheConfig(kv_cache_memory=None, gpu_memory_utilization=0.25, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        speculative=base.speculative,
    )
    core = EngineCore(cfg)
    try:
        worker = core.executor.worker
        assert probe.calls == ["start", "loaded", "stepping", "facts"]
        budget = 512 * MiB - 256 * MiB - 64 * MiB
        spec = build_specs(cfg, 0)
        slot = sum(s.page_size_bytes for s in spec if s.kind == "gdn")
        page = sum(s.page_size_bytes for s in spec if s.kind != "gdn")
        assert worker.memory_plan.budget == budget
        assert worker.capacity.num_blocks == (budget - 8 * slot * (1 + (k + 1 if k else 0))) // page
        assert next(iter(worker.pools.kv.values())).shape[0] == worker.capacity.num_blocks
        sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        rids = [core.add_request(list(p), sp) for p in prompts]
        done = {}
        while len(done) < len(rids):
            done.update((o.request_id, o) for o in core.step() if o.finished)
        assert [done[r].output_token_ids for r in rids] == hf_ref_hv2
    finally:
        core.close()


def test_a_profile_step_out_of_memory_says_what_to_lower(ckpt_hv2, monkeypatch):
    import engine.worker

    def oom(self, step):
        raise torch.OutOfMemoryError("CUDA out of memory")  # what a device too small for the step raises

    monkeypatch.setattr(engine.worker, "CudaProbe", lambda device: FakeProbe(FACTS))
    monkeypatch.setattr(engine.worker.Worker, "_execute", oom)
    base = EngineArgs(ckpt_hv2, dtype="float32").engine_config()
    cfg = EngineConfig(base.model, cache=CacheConfig(kv_cache_memory=None, gpu_memory_utilization=0.5))
    with pytest.raises(ValueError, match=r"profile step \(2048 prompt tokens over up to 64 rows\) ran out of device"):
        engine.worker.Worker(cfg)


@pytest.mark.gpu
def test_cuda_plan_fits_the_fraction(ckpt_hv2, prompts):
    from engine import LLM

    total = torch.cuda.mem_get_info()[1]
    llm = LLM(ckpt_hv2, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.5, engine_process=False)
    try:
        worker = llm.engine.executor.worker
        plan = worker.memory_plan
        assert plan is not None and not plan.explicit and plan.facts.total == total
        assert plan.facts.weights > 0 and plan.facts.peak > 0
        f = plan.facts
        assert plan.budget + f.weights + f.peak + f.outside <= 0.5 * total
        assert plan.capacity.num_blocks > 0 and worker.pools.kv
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=8, temperature=0.0))
        assert all(len(o.output_token_ids) == 8 for o in outs)
        torch.cuda.synchronize()
        # this process's memory after pools and a generate: PyTorch's allocator (the decode graphs'
        # pools included, which the plan cannot see: small for this model) and what start-up put
        # outside it, within the fraction; the device-wide free figure would count other test
        # workers' engines, which come and go
        assert torch.cuda.memory_reserved() + f.outside <= 0.5 * total + 256 * MiB
    finally:
        llm.close()


def test_up_hands_the_option_to_each_pool(ckpt_hv2, tmp_path):
    """`pdserve up`: the file's fraction reaches both pools' nodes, a pool's own key wins for that
    pool, and the nodes read the flag back; a fraction out of range is refused first."""
    from router.cli import _up_spec, build_parser

    cfg = tmp_path / "pools.yaml"
    cfg.write_text(
        f"model: {ckpt_hv2}\nport: 0\ngpu_memory_utilization: 0.6\ndecode: {{gpu_memory_utilization: 0.8}}\n"
    )
    spec = _up_spec(build_parser().parse_args(["up", "--config", str(cfg)]))
    for kind, want in (("prefill", 0.6), ("decode", 0.8)):
        argv = spec.node_argv(kind)
        assert float(argv[argv.index("--gpu-memory-utilization") + 1]) == want
        assert build_parser().parse_args([kind, *argv]).gpu_memory_utilization == want
    cfg.write_text(f"model: {ckpt_hv2}\nport: 0\ngpu_memory_utilization: 1.5\n")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        _up_spec(build_parser().parse_args(["up", "--config", str(cfg)]))
