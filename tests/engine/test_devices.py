"""The device of each tensor-parallel rank (engine/devices.py), for TP 1, 2, 4 and 8 on nodes
that see more, as many, or fewer CUDA devices than they have ranks, without a GPU; and a node
asked for CUDA ranks it cannot place stops before starting any, with one line saying why."""

from __future__ import annotations

import pytest
import torch

from engine.devices import StepFence, rank_devices


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_rank_r_uses_local_device_r(tp):
    for visible in (tp, 8):
        assert rank_devices("cuda", tp, visible) == [torch.device("cuda", r) for r in range(tp)]
    assert rank_devices("cpu", tp, 0) == [torch.device("cpu")] * tp


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_listed_devices_in_rank_order(tp):
    idx = list(range(8 - tp, 8))[::-1]  # the node's last tp devices, in reverse
    device = "cuda:" + ",".join(map(str, idx))
    assert rank_devices(device, tp, 8) == [torch.device("cuda", i) for i in idx]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_fewer_devices_than_ranks_is_one_clear_line(tp, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError) as e:
        rank_devices("cuda", tp, 1)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{tp} tensor-parallel rank(s)" in msg and "this node sees 1 (CUDA_VISIBLE_DEVICES=0)" in msg


@pytest.mark.parametrize(
    "device,tp,visible,words",
    [
        ("cuda:0,0", 2, 8, "twice"),
        ("cuda:0,1", 4, 8, "names 2 CUDA device(s) for 4"),
        ("cuda:3", 1, 2, "need CUDA device(s) [3]; this node sees 2"),
        ("cuda:a,b", 2, 8, "must be integers"),
        ("mps", 1, 0, "cpu, cuda or cuda:N"),
        ("cuda", 1, 0, "this node sees 0"),
    ],
)
def test_bad_mappings(device, tp, visible, words):
    with pytest.raises(ValueError) as e:
        rank_devices(device, tp, visible)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_node_without_gpus_refuses_cuda_ranks_before_starting_them(ckpt_hv2):
    """make_executor checks the mapping in the node's process: no rank is spawned."""
    from engine.config import EngineArgs
    from engine.executor import make_executor

    cfg = EngineArgs(model=str(ckpt_hv2), tensor_parallel_size=2, device="cuda:0,15").engine_config()
    with pytest.raises(ValueError, match="this node sees"):
        make_executor(cfg)


def test_a_refused_setting_at_tp2_is_the_one_line_of_tp1(ckpt_hv2, monkeypatch):
    """A cache too small for the state slots: the ranks' refusal reaches the caller as the same
    ValueError one rank raises (the CLI prints it as one line), not a worker's traceback; every
    rank's pipe shows it gone (none left for close() to wait out and kill)."""
    import engine.executor as ex
    from engine.config import EngineArgs
    from engine.executor import make_executor

    closed: list[bool] = []  # what close() saw of each rank's pipe
    real_closed = ex._closed

    def recording(conn, timeout: float) -> bool:
        closed.append(real_closed(conn, timeout))
        return closed[-1]

    monkeypatch.setattr(ex, "_closed", recording)
    msgs = []
    for tp in (1, 2):
        cfg = EngineArgs(model=str(ckpt_hv2), tensor_parallel_size=tp, kv_cache_memory="1KiB").engine_config()
        with pytest.raises(ValueError, match="leaves no room for KV pages") as e:
            make_executor(cfg)
        assert "Traceback" not in str(e.value)
        msgs.append(str(e.value))
    assert msgs[1].split(" leaves")[0] == msgs[0].split(" leaves")[0]
    assert closed == [True, True]


def test_fence_is_a_no_op_on_the_cpu():
    f = StepFence(torch.device("cpu"))
    f.record()
    f.wait()
    assert f.mark() is None  # a layer's ops have run when the CPU forward calls its hook


@pytest.mark.gpu
def test_a_mark_passes_once_the_kernels_before_it_ran():
    dev = torch.device("cuda", 0)
    f = StepFence(dev)
    x = torch.randn(4096, 4096, device=dev)
    y = x @ x  # queued work before the mark
    m = f.mark()
    assert m is not None
    torch.cuda.synchronize(dev)
    assert m.query() and torch.isfinite(y).all()
