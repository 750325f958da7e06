"""lm-evaluation-harness against `pdserve up` (not a test: lm-eval is not a dependency). Runs a
multiple-choice task (loglikelihood: `echo` + `logprobs` on /v1/completions), a rolling perplexity
task (loglikelihood_rolling, the same requests over token windows), a generation task on
/v1/completions and the same generation through /v1/chat/completions with the chat template, on
local data (no download), and checks that every task reports its metric.

    python bench/lm_eval_check.py --lm-eval-python /path/to/venv/bin/python [--prefill 1] [--vs-hf]

The venv needs `lm-eval[api]`, transformers and datasets (any versions lm-eval accepts). With
`--vs-hf` (the venv also needs accelerate) the server runs in float32 and lm-eval's own
transformers backend (`--model hf`) scores the same tasks: every sample's loglikelihood must agree
within 1e-3, its is_greedy flag and its generated text exactly.
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

WORDS = "red green blue cat dog bird one two three sun moon star".split()


def write_tasks(d: Path) -> list[str]:
    """Three local tasks: pdserve_mc (multiple choice), pdserve_gen (generate_until), pdserve_ppl
    (loglikelihood_rolling)."""
    rows = [
        {"question": f"Q{i}: {' '.join(WORDS[i % 12 : i % 12 + 3])}?", "choices": WORDS[:4], "label": i % 4}
        for i in range(24)
    ]
    data = d / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (d / "pdserve_mc.yaml").write_text(
        "task: pdserve_mc\n" + common + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    (d / "pdserve_gen.yaml").write_text(
        "task: pdserve_gen\n" + common + "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{choices[label]}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    (d / "pdserve_ppl.yaml").write_text(
        "task: pdserve_ppl\n" + common + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{question}} {{choices|join(\' \')}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    return ["pdserve_mc", "pdserve_gen", "pdserve_ppl"]


def lm_eval(py: str, model_type: str, args: str, tasks: list[str], d: Path, extra=()) -> dict:
    out = d / f"out-{model_type}"
    cmd = [py, "-m", "lm_eval", "run", "--model", model_type, "--model_args", args, "--tasks", *tasks]
    cmd += ["--include_path", str(d), "--output_path", str(out), "--log_samples", *extra]
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env |= {"USE_HUB_KERNELS": "0"}  # transformers' own models without the hub's kernels (README)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"lm_eval {model_type} exited {r.returncode}:\n{r.stderr[-3000:]}")
    res = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    return {t: {k: v for k, v in m.items() if "," in k and "stderr" not in k} for t, m in res.items()}


def samples(d: Path, model_type: str, task: str) -> dict[int, list]:
    """Each document's responses in lm-eval's --log_samples output of one run."""
    f = next((d / f"out-{model_type}").rglob(f"samples_{task}_*.jsonl"))
    return {r["doc_id"]: [x[0] for x in r["resps"]] for r in map(json.loads, f.read_text().splitlines())}


def disagreements(d: Path, tasks: list[str]) -> list[str]:
    """Samples where pdserve (local-completions) and transformers (hf) differ: a loglikelihood by
    more than 1e-3, an is_greedy flag, a generated text."""
    bad = []
    for task in tasks:
        ours, ref = samples(d, "local-completions", task), samples(d, "hf", task)
        for doc, rs in ours.items():
            for a, b in zip(rs, ref[doc], strict=True):
                if task == "pdserve_gen":  # generate_until: the text
                    same = a == b
                else:  # [loglikelihood, is_greedy] or a rolling loglikelihood
                    a, b = (a, b) if isinstance(a, list) else ([a], [b])
                    same = abs(float(a[0]) - float(b[0])) <= 1e-3 and a[1:] == b[1:]
                if not same:
                    bad.append(f"{task} doc {doc}: pdserve {a!r}, transformers {b!r}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lm-eval-python", required=True)
    ap.add_argument("--prefill", type=int, default=1, help="prefill nodes (0: colocated)")
    ap.add_argument("--vs-hf", action="store_true", help="float32, and every sample against lm-eval's hf model")
    args = ap.parse_args()
    model = vs.make_models(["tiny"], Path.home() / ".cache")["tiny"]
    with tempfile.TemporaryDirectory() as tmp, open("/tmp/lm_eval_check-server.log", "w") as log:
        d = Path(tmp)
        tasks = write_tasks(d)
        kind = "pdserve-disagg" if args.prefill else "pdserve"
        extra = ["--dtype", "float32"] if args.vs_hf else []
        proc, base, name = vs.start_server(kind, model, sys.executable, log, extra)
        try:
            common = f"model={name},tokenizer={model},tokenizer_backend=huggingface,num_concurrent=4,max_retries=1"
            results = {
                "completions": lm_eval(
                    args.lm_eval_python, "local-completions", f"{common},base_url={base}/v1/completions", tasks, d
                ),
                "chat": lm_eval(
                    args.lm_eval_python,
                    "local-chat-completions",
                    f"{common},base_url={base}/v1/chat/completions",
                    ["pdserve_gen"],
                    d,
                    ["--apply_chat_template"],
                ),
            }
        finally:
            vs.stop_server(proc)
        if args.vs_hf:
            hf = f"pretrained={model},dtype=float32"
            results["hf"] = lm_eval(args.lm_eval_python, "hf", hf, tasks, d, ["--batch_size", "1"])
            bad = disagreements(d, tasks)
            print("\n".join(bad[:20]) or "every sample agrees with transformers")
            if bad:
                raise SystemExit(f"{len(bad)} samples differ from lm-eval's transformers backend")
    print(json.dumps(results, indent=1))
    missing = [(api, t) for api, r in results.items() for t, m in r.items() if not m]
    if missing or set(results["completions"]) != set(tasks):
        raise SystemExit(f"tasks without metrics: {missing}")
    print("lm-eval ran every task against pdserve")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
