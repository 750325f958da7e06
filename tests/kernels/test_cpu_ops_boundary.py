"""The edges of the CPU operators (kernels/cpu_ops.py, kernels/build.py): each operator refuses
bad arguments with a RuntimeError that quotes what it got, before touching memory; the loader
falls back to the PyTorch path with a WARNING that names the reason and the build command; the
CPU image builds the library and checks that it loads."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kernels import build, cpu_ops

ROOT = Path(__file__).resolve().parents[2]


def _gdn_args(B=2, hk=2, hv=4, dk=16, dv=16, kc=4, S=5):
    g = torch.Generator().manual_seed(0)
    D = 2 * hk * dk + hv * dv
    return dict(
        proj=torch.randn(B, D + hv * dv + 2 * hv, generator=g),
        conv_w=torch.randn(D, kc, generator=g),
        conv_pool=torch.zeros(S, D, kc - 1),
        rec_pool=torch.zeros(S, hv, dk, dv),
        slots=torch.arange(B),
        neg_A=-torch.rand(hv, generator=g),
        dt_bias=torch.randn(hv, generator=g),
        norm_w=torch.ones(dv),
        hk=hk,
        hv=hv,
        dk=dk,
        dv=dv,
        eps=1e-6,
    )


def test_gdn_decode_runs_with_good_arguments():
    a = _gdn_args()
    assert cpu_ops.gdn_decode(**a).shape == (2, 4 * 16)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(proj=torch.randn(2, 7)), r"proj must be \[\*, 200\], got \[2, 7\]"),
        (dict(conv_pool=torch.zeros(5, 128, 3, dtype=torch.bfloat16)), r"conv_pool must have proj's dtype"),
        (dict(rec_pool=torch.zeros(5, 4, 16, 8)), r"rec_pool must be \[5, 4, 16, 16\], got \[5, 4, 16, 8\]"),
        (dict(rec_pool=torch.zeros(5, 4, 16, 16).transpose(2, 3)), r"rec_pool \[5, 4, 16, 16\] must be contiguous"),
        (dict(slots=torch.tensor([0, 5])), r"slots\[1\] = 5 is outside \[0, 5\)"),
        (dict(slots=torch.tensor([0, 1], dtype=torch.int32)), r"slots must be Long, got Int"),
        (dict(neg_A=torch.zeros(3)), r"neg_A must be \[4\], got \[3\]"),
        (dict(proj=torch.randn(2, 200, dtype=torch.float16)), r"proj must be float32 or bfloat16, got Half"),
        (dict(hv=3), r"hv a multiple of hk"),
    ],
    ids=["proj-width", "pool-dtype", "rec-shape", "rec-strides", "slot-range", "slot-dtype", "neg-A", "fp16", "heads"],
)
def test_gdn_decode_refuses_bad_arguments(change, message):
    a = _gdn_args() | change
    before = (a["conv_pool"].clone(), a["rec_pool"].clone())
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.gdn_decode(**a)
    assert torch.equal(a["conv_pool"], before[0]) and torch.equal(a["rec_pool"], before[1]), "a pool was written"


def test_attn_decode_refuses_a_block_table_past_the_pool():
    h, kvh, hd, bs, nb = 2, 1, 16, 4, 3
    kv = torch.zeros(nb, 2, kvh, bs, hd)
    qkv = torch.randn(1, 2 * (h + kvh) * hd)
    cos, sin = torch.ones(1, 8), torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match=r"block_tables\[1\] = 3 is outside \[0, 3\)"):
        cpu_ops.attn_decode(
            qkv,
            torch.ones(h + kvh, hd),
            1e-6,
            cos,
            sin,
            kv,
            torch.tensor([1]),
            torch.tensor([[0, 3]]),
            torch.tensor([5]),
            h,
            kvh,
            0.25,
        )
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 9 is outside \[1, 9\)"):
        cpu_ops.attn_decode(
            qkv,
            torch.ones(h + kvh, hd),
            1e-6,
            cos,
            sin,
            kv,
            torch.tensor([1]),
            torch.tensor([[0, 2]]),
            torch.tensor([9]),
            h,
            kvh,
            0.25,
        )


def test_gemm_and_norm_quote_their_shapes():
    wp = cpu_ops.pack_f32(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match=r"wp \(packed for n\) must be \[1, 8, 16\], got \[2, 8, 16\]"):
        cpu_ops.gemm_f32(torch.randn(3, 8), wp, 16)
    with pytest.raises(RuntimeError, match=r"pdserve.gemm_bf16: wp must be BFloat16"):
        cpu_ops.gemm_bf16(torch.randn(3, 8).bfloat16(), wp, 20)  # float32 panels handed to the bfloat16 GEMM
    wp16 = cpu_ops.pack_bf16(torch.randn(20, 7).bfloat16())
    with pytest.raises(RuntimeError, match=r"pdserve.gemm_bf16: x must be BFloat16"):
        cpu_ops.gemm_bf16(torch.randn(3, 7), wp16, 20)  # float32 x
    with pytest.raises(RuntimeError, match=r"wp \(packed for n\) must be \[2, 5, 16, 2\], got \[2, 4, 16, 2\]"):
        cpu_ops.gemm_bf16(torch.randn(3, 9).bfloat16(), wp16, 20)  # packed for K = 7
    with pytest.raises(RuntimeError, match=r"pdserve.pack_bf16: w must be BFloat16"):
        cpu_ops.pack_bf16(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match=r"h must be \[4, 8\], got \[4, 6\]"):
        cpu_ops.add_rms_norm(torch.randn(4, 8), torch.randn(4, 6), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"gu must be \[M, 2I\], got \[3, 5\]"):
        cpu_ops.silu_mul(torch.randn(3, 5))


_NO_ROWS = """
import torch
from kernels import cpu_ops
N, K = 40, 24
w = torch.randn(N, K)
for threads in (1, 2, 4):
    assert cpu_ops.gemm_f32(torch.zeros(0, K), cpu_ops.pack_f32(w), N, threads).shape == (0, N)
    if cpu_ops.available(torch.bfloat16):
        wp = cpu_ops.pack_bf16(w.bfloat16())
        for dot in [False] + [True] * cpu_ops.bf16_dot_supported():
            assert cpu_ops.gemm_bf16(torch.zeros(0, K, dtype=torch.bfloat16), wp, N, threads, dot).shape == (0, N)
        assert cpu_ops.gemv_bf16(torch.zeros(0, K, dtype=torch.bfloat16), w.bfloat16(), torch.float32, threads).shape == (0, N)
print("ok")
"""


def test_gemms_take_no_rows_on_any_thread_count():
    """A projection over no rows (a prompt chunk without logits, under MTP) returns [0, N]: with
    threads, the GEMMs once divided the row blocks among them by zero, which gcc compiles to a
    trap (SIGILL). In a process of its own, so a trap fails this test alone."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _NO_ROWS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("how", ["missing", "stale"])
def test_loader_falls_back_with_a_warning_naming_the_command(how, monkeypatch, tmp_path, caplog):
    if how == "missing":
        monkeypatch.setattr(build, "LIB", tmp_path / "none.so")
    else:
        monkeypatch.setattr(build, "source_digest", lambda: "0" * 16)
    monkeypatch.setattr(cpu_ops, "_state", None)
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels"):
        assert not cpu_ops.available(torch.float32)
    [rec] = [r for r in caplog.records if r.name == "pdserve.kernels"]
    assert rec.levelno == logging.WARNING
    assert ("is not built" if how == "missing" else "other sources") in rec.getMessage()
    assert "python -m kernels.build" in rec.getMessage() and "PyTorch path" in rec.getMessage()


def test_cpu_image_builds_the_operators_and_checks_they_load():
    text = (ROOT / "deploy" / "docker" / "Dockerfile.cpu").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    stages = [i for i, ln in enumerate(lines) if ln.startswith("FROM ")]
    assert len(stages) == 3, "stages: torch, the operator build, the image"
    build_stage, image = lines[stages[1] : stages[2]], lines[stages[2] :]
    assert any("g++" in ln for ln in build_stage) and any("python -m kernels.build" in ln for ln in build_stage)
    assert not any("g++" in ln or "apt-get" in ln for ln in image), "the image itself has no compiler"
    copy = next(i for i, ln in enumerate(image) if ln.startswith("COPY --from=ops") and "pdserve_cpu_ops.so" in ln)
    install = next(i for i, ln in enumerate(image) if ln.startswith("RUN pip install ."))
    check = next(i for i, ln in enumerate(image) if "cpu_ops.status()" in ln and "assert not why" in ln)
    assert copy < install < check
    ignore = (ROOT / "deploy" / "docker" / "Dockerfile.cpu.dockerignore").read_text().split()
    assert "kernels/_ops/" in ignore, "a local build must not reach the image"


def test_decode_layers_refuse_a_layer_that_does_not_fit():
    """torch.classes.pdserve.DecodeLayers checks a layer's tensors when it is added: a packed
    output projection for the wrong width is refused with both shapes quoted."""
    a = _gdn_args()
    H, hv, dv, I = 32, a["hv"], a["dv"], 24
    D = a["conv_w"].shape[0]
    pack = cpu_ops.pack_f32
    layers = torch.classes.pdserve.DecodeLayers(H, 1e-6, False)
    common = (torch.ones(H), torch.ones(H), pack(torch.randn(D + hv * dv + 2 * hv, H)))
    mlp = (pack(torch.randn(2 * I, H)), pack(torch.randn(H, I)), 2 * I)
    gdn = (a["conv_w"], a["conv_pool"], a["rec_pool"], a["neg_A"], a["dt_bias"], a["norm_w"], 2, hv, 16, dv, 1e-6)
    layers.add_gdn(*common, pack(torch.randn(H, hv * dv)), *mlp, *gdn)
    with pytest.raises(RuntimeError, match=r"w_out takes 48 inputs, the GDN gives 64"):
        layers.add_gdn(*common, pack(torch.randn(H, 48)), *mlp, *gdn)
    with pytest.raises(RuntimeError, match=r"x must be \[\*, 32\], got \[2, 16\]"):
        torch.ops.pdserve.decode_layers_run(
            layers,
            torch.randn(2, 16),
            torch.arange(2),
            torch.zeros(2, dtype=torch.long),
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, dtype=torch.long),
            torch.ones(2, 8),
            torch.zeros(2, 8),
        )
