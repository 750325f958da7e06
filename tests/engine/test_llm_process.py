"""The offline LLM with its engine in a process of its own (engine/llm_process.py): a script that
imports torch before the engine, the way users write it, gets an engine process (it would
otherwise run under OpenMP's spinning threads), whose greedy tokens and logprobs equal the
in-process engine's; bad input raises ValueError with the engine's message; close ends the
process. Real processes: the script runs in a fresh interpreter without OMP_WAIT_POLICY."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 300, 42, 9], [1, 2, 3], [77, 1000, 3, 8, 8, 8]]

SCRIPT = """
import json, sys
import torch  # first, as users write it
from engine import LLM, SamplingParams

llm = LLM(sys.argv[1], dtype="float32")
assert llm.engine is None, "expected the engine in a process of its own"
sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=sp)
try:
    llm.generate(prompt_token_ids=[[10**9]], sampling_params=sp)
    err = None
except ValueError as e:
    err = str(e)
cap = llm.capacity()
proc = llm._proc.proc
llm.close()
print(json.dumps({
    "tokens": [o.output_token_ids for o in outs],
    "logprobs": [[lp for _, lp, _ in o.logprobs] for o in outs],
    "error": err,
    "blocks": cap.num_blocks,
    "exited": proc.poll() is not None,
}))
""".replace("PROMPTS", repr(PROMPTS))


def test_script_importing_torch_first_gets_an_engine_process(ckpt_hv2, llm_hv2):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ckpt_hv2)], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    want = llm_hv2.generate(prompt_token_ids=PROMPTS, sampling_params=sp)
    assert got["tokens"] == [o.output_token_ids for o in want]
    for g, o in zip(got["logprobs"], want):
        assert max(abs(a - lp) for a, (_, lp, _) in zip(g, o.logprobs)) < 1e-5
    assert got["error"] is not None and got["error"].startswith("prompt 0:")
    assert got["blocks"] == llm_hv2.capacity().num_blocks
    assert got["exited"]


# a script file as users write one: no `if __name__ == "__main__":` guard around the LLM, no close()
UNGUARDED = """
import json, sys
from engine import LLM, SamplingParams

llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32")
sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
print(json.dumps([o.output_token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=sp)]))
""".replace("PROMPTS", repr(PROMPTS))


def test_unguarded_script_at_tp2_starts_its_ranks(ckpt_hv2, tmp_path):
    """Ranks start without running the script's module again (multiprocessing would, and the
    script's LLM built inside a rank killed it at start); tokens are transformers'; the script
    exits without closing its LLM (the ranks ignore multiprocessing's SIGTERM at exit and waited
    on a pipe only close() ends: it hung)."""
    from tests.helpers import hybrid_ckpt as hc

    script = tmp_path / "generate.py"
    script.write_text(UNGUARDED)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, str(script), str(ckpt_hv2)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "bootstrapping phase" not in r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [hc.hf_greedy(str(ckpt_hv2), p, 8) for p in PROMPTS]
