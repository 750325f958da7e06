"""The `pdserve` CLI: make-tiny-model writes a checkpoint transformers and we both load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, env_extra=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )


TINY_ARGS = ("--layers", "4", "--hidden", "128", "--seed", "3")


@pytest.fixture(scope="module")
def cli_tiny(tmp_path_factory):
    """`pdserve make-tiny-model DIR --layers 4 --hidden 128 --seed 3` in a process of its own (a
    fresh process costs seconds of imports: the three tests below share one), and the proto modules
    that process had imported when it was done."""
    out = tmp_path_factory.mktemp("cli") / "tiny"
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['pdserve', 'make-tiny-model', {str(out)!r}, *{TINY_ARGS!r}]\n"
        "try:\n    runpy.run_module('router.cli', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(sorted(m for m in sys.modules if m == 'proto' or m.startswith('proto.')))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    return out, r.stdout.strip().splitlines()[-1]


def test_make_tiny_model_loads_everywhere(cli_tiny):
    tiny = cli_tiny[0]
    from transformers import AutoConfig, AutoTokenizer

    from engine import LLM, SamplingParams

    cfg = AutoConfig.from_pretrained(tiny)
    assert cfg.architectures == ["Qwen3_5ForCausalLM"] and cfg.num_hidden_layers == 4 and cfg.hidden_size == 128
    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok("Hello world").input_ids
    assert tok.decode(ids) == "Hello world"
    with LLM(str(tiny), dtype="float32") as llm:
        out = llm.generate(prompts=["Hello world"], sampling_params=SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert out.prompt_token_ids == ids and 1 <= len(out.output_token_ids) <= 5
    assert isinstance(out.text, str)


def test_same_seed_same_checkpoint(cli_tiny, tmp_path):
    from safetensors.torch import load_file

    from router.cli import build_parser

    # the fixture's, made in a process of its own, and the same command in this one
    args = build_parser().parse_args(["make-tiny-model", str(tmp_path / "b"), *TINY_ARGS])
    assert args.func(args) == 0
    a, b = load_file(cli_tiny[0] / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_errors_are_one_line(tmp_path):
    (tmp_path / "ck").mkdir()
    r = run_cli("demo", "--model", str(tmp_path / "ck"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no config.json" in r.stderr and "Traceback" not in r.stderr


def test_tooling_commands_do_not_load_the_wire_stubs(cli_tiny):
    """make-tiny-model runs where only the engine's packages work (a GPU image whose grpcio is older
    than the generated stubs require): building the CLI's parser must not import proto's stubs."""
    assert cli_tiny[1] == "[]", cli_tiny[1]
