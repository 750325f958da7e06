"""The text report of tools/gpu_check.sh run, from the files its steps left in OUT.

python tools/gpu_report.py tests-summary OUT/tests.xml      one line: passed, failed, skipped
python tools/gpu_report.py report OUT STARTED FAILED        the whole report, on stdout
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path


def test_counts(xml: Path) -> tuple[Counter, Counter]:
    """(outcome counts, skip reasons) of a pytest junit file."""
    counts, reasons = Counter(), Counter()
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
        elif "error" in kinds:
            counts["errors"] += 1
        elif "skipped" in kinds:
            counts["skipped"] += 1
            reasons[case.find("skipped").get("message", "")] += 1
        else:
            counts["passed"] += 1
    return counts, reasons


def tests_summary(xml: Path) -> str:
    counts, reasons = test_counts(xml)
    parts = [f"{counts[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if counts[k]]
    line = ", ".join(parts) or "no tests"
    if reasons:
        line += " (skipped: " + "; ".join(f"{n} {r.removeprefix('Skipped: ')}" for r, n in reasons.items()) + ")"
    return line


def ratios(bench: dict) -> list[str]:
    if "skipped" in bench:
        return [f"  benchmark skipped: {bench['skipped']}"]
    lines = []
    for r in bench.get("gdn_prefill", []):
        what = f"  GDN chunked prefill {r['batch']} x {r['tokens']} tokens: ours {r['ours_ms']:.3f} ms"
        if "ratio_fla_over_ours" in r:
            what += f", fla {r['fla_ms']:.3f} ms, fla/ours {r['ratio_fla_over_ours']:.2f}"
        else:
            what += f" ({r.get('fla_error', 'flash-linear-attention not installed')})"
        lines.append(what)
    if "gdn_prefill_engine" in bench:
        lines.append(f"  GDN prefill in the engine: {bench['gdn_prefill_engine']}")
    for r in bench.get("sampler", []):
        lines.append(f"  sampler batch {r['batch']}, vocab {r['vocab']}, {r['case']}: {r['us']:.0f} us a call")
    for key, name in (("decode", "decode step, eager"), ("decode_graphs", "decode step, CUDA graphs")):
        if key not in bench:
            continue
        d = bench[key]
        gpu = ""
        if "batch1_gpu_ms" in d:
            gpu = f" (GPU kernels {d['batch1_gpu_ms']:.2f} / {d['batch64_gpu_ms']:.2f} ms)"
        lines.append(
            f"  {name}: batch 1 {d['batch1_ms']:.2f} ms, batch 64 {d['batch64_ms']:.2f} ms{gpu}, "
            f"throughput 64*t1/t64 {d['ratio_throughput_64_over_1']:.1f}"
        )
    for r in bench.get("transfer", []):
        lines.append(
            f"  transfer TP {r['tp']} {r['tokens']} tokens ({r['bytes'] / 1e6:.1f} MB, VRAM): {r['gbs']:.2f} GB/s, "
            f"contiguous NIXL WRITE / ours {r['ratio_contig_over_ours']:.2f}"
        )
    return lines


def report(out: Path, started: str, failed: bool) -> str:
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    steps = (out / "steps.txt").read_text().splitlines() if (out / "steps.txt").exists() else []
    gpu = env.get("gpu")
    lines = [
        "pdserve GPU check",
        f"date: {started} (finished {datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')})",
        f"gpu: {gpu or 'none: torch.cuda.is_available() is False'}",
        f"python: {env.get('python', 'unknown')}",
        f"torch CUDA: {env.get('torch_cuda')}",
        "versions: " + ", ".join(env.get("packages", {}).values()),
        "steps:",
        *(f"  {s}" for s in steps),
        "ratios:",
    ]
    bench = out / "bench.json"
    lines += ratios(json.loads(bench.read_text())) if bench.exists() else ["  (no benchmark ran)"]
    if failed:
        bad = [s.split()[0] for s in steps if " FAIL " in f" {s} "]
        result = f"result: FAIL ({', '.join(bad) or 'see the logs'})"
    elif not gpu:
        counts, _ = test_counts(out / "tests.xml") if (out / "tests.xml").exists() else (Counter(), None)
        result = (
            f"result: NO GPU (no CUDA device: the {counts['skipped']} gpu tests were collected and skipped, "
            "the benchmark skipped; the CUDA path was not checked)"
        )
    else:
        result = "result: PASS"
    lines.append(result)
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["tests-summary"] and len(argv) == 2:
        print(tests_summary(Path(argv[1])))
        return 0
    if argv[:1] == ["report"] and len(argv) == 4:
        sys.stdout.write(report(Path(argv[1]), argv[2], argv[3] != "0"))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
