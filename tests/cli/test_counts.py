"""Token counts in vLLM's human-readable forms (`--max-model-len 128k`): engine/options.py `count`,
against the arithmetic written out here, on the command line and in a pools file."""

from __future__ import annotations

import pytest

from engine.options import count
from router.cli import build_parser, main
from tests.helpers import hybrid_ckpt as hc


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("counts") / "ckpt", hc.SPEC_HV2)


@pytest.mark.parametrize(
    "text,want",
    [("4096", 4096), ("128k", 128 * 1000), ("25.6k", 25600), ("1M", 10**6), ("1m", 10**6)]
    + [("32Ki", 32 * 1024), ("32K", 32 * 1024), ("2Mi", 2 * 1024 * 1024), (" 8k ", 8000)],
)
def test_counts_read_as_vllm_reads_them(text, want):
    assert count(text) == want


def test_the_flags_and_a_pools_file_take_them(tmp_path, capsys, ckpt):
    a = build_parser().parse_args(["up", "--max-model-len", "32Ki", "--max-num-batched-tokens", "8k"])
    assert (a.max_model_len, a.max_num_batched_tokens) == (32768, 8000)
    for bad in ("1.5Ki", "k", "12q", "-"):
        with pytest.raises(SystemExit) as e:
            main(["up", "--max-model-len", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is not a count" in err[0], err
    from router.pools import spec_from_args

    f = tmp_path / "pools.yaml"
    f.write_text(f"model: {ckpt}\nmax-model-len: 2k\ndecode: {{count: 1, max-num-batched-tokens: 2Ki}}\n")
    spec = spec_from_args(build_parser().parse_args(["up", "--config", str(f)]), default_model=lambda: None)
    assert (spec.decode_options["max_model_len"], spec.decode_options["max_num_batched_tokens"]) == (2000, 2048)
