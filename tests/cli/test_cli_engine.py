"""The `pdserve` CLI: make-tiny-model writes a checkpoint transformers and we both load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, env_extra=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )


def test_make_tiny_model_loads_everywhere(tmp_path):
    r = run_cli("make-tiny-model", str(tmp_path / "tiny"), "--layers", "4", "--hidden", "128", "--seed", "3")
    assert r.returncode == 0, r.stderr
    from transformers import AutoConfig, AutoTokenizer

    from engine import LLM, SamplingParams

    cfg = AutoConfig.from_pretrained(tmp_path / "tiny")
    assert cfg.architectures == ["Qwen3_5ForCausalLM"] and cfg.num_hidden_layers == 4 and cfg.hidden_size == 128
    tok = AutoTokenizer.from_pretrained(tmp_path / "tiny")
    ids = tok("Hello world").input_ids
    assert tok.decode(ids) == "Hello world"
    with LLM(str(tmp_path / "tiny"), dtype="float32") as llm:
        out = llm.generate(prompts=["Hello world"], sampling_params=SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert out.prompt_token_ids == ids and 1 <= len(out.output_token_ids) <= 5
    assert isinstance(out.text, str)


def test_same_seed_same_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from router.cli import build_parser

    # one in a process of its own, one in this one (a fresh process each costs seconds of imports)
    assert run_cli("make-tiny-model", str(tmp_path / "a"), "--layers", "4", "--no-tokenizer").returncode == 0
    args = build_parser().parse_args(["make-tiny-model", str(tmp_path / "b"), "--layers", "4", "--no-tokenizer"])
    assert args.func(args) == 0
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_errors_are_one_line(tmp_path):
    (tmp_path / "ck").mkdir()
    r = run_cli("demo", "--model", str(tmp_path / "ck"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no config.json" in r.stderr and "Traceback" not in r.stderr


def test_tooling_commands_do_not_load_the_wire_stubs(tmp_path):
    """make-tiny-model runs where only the engine's packages work (a GPU image whose grpcio is older
    than the generated stubs require): building the CLI's parser must not import proto's stubs."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['pdserve', 'make-tiny-model', {str(tmp_path / 't')!r}, '--layers', '2', '--hidden', '64', '--no-tokenizer']\n"
        "try:\n    runpy.run_module('router.cli', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(sorted(m for m in sys.modules if m == 'proto' or m.startswith('proto.')))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
