"""What a bfloat16 GDN recurrent state (--mamba-ssm-cache-dtype bfloat16) costs on a tiny
checkpoint (hybrid_ckpt.SPEC_BF16's: weights std 0.1, dk = dv = 64, in each model dtype): greedy top-1 agreement with transformers, teacher-forced (one full
transformers forward over prompt + the engine's tokens; a token agrees when it is within 1e-4 of
transformers' max logit), the largest logit shortfall, and the engine's decode speed (the
bfloat16 state runs the GDN layers on the PyTorch path, not the fused CPU operators).

    python bench/ssm_dtype.py [--new-tokens 256] [--prompt-lens 3 40 200 64]"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402 (first: the engine sets OpenMP's policy)
from tests.helpers import hybrid_ckpt as hc  # noqa: E402

TOL = 1e-4


def run(path: str, dtype: str, state: str, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float]:
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    with LLM(path, dtype=dtype, mamba_ssm_cache_dtype=state) as llm:
        llm.generate(prompt_token_ids=[prompts[0][:4]], sampling_params=SamplingParams(max_tokens=2, temperature=0.0))
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        return [o.output_token_ids for o in outs], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[3, 40, 200, 64])
    a = ap.parse_args()
    import torch

    prompts = hc.prompts(lens=tuple(a.prompt_lens), seed=5)
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, spec in (("float32", replace(hc.SPEC_BF16, dtype="float32")), ("bfloat16", hc.SPEC_BF16)):
            path = hc.make(Path(tmp) / dtype, spec)
            for state in ("float32", "bfloat16"):
                toks, dt = run(path, dtype, state, prompts, a.new_tokens)
                short = torch.cat(
                    [hc.hf_logit_shortfall(path, p, t, dtype=getattr(torch, dtype)) for p, t in zip(prompts, toks)]
                )
                agree = int((short <= TOL).sum())
                print(
                    f"model {dtype:8s} state {state:8s}: top-1 agreement {agree}/{short.numel()} "
                    f"({100 * agree / short.numel():.1f}%), max shortfall {short.max().item():.4f}, "
                    f"{sum(map(len, toks)) / dt:.0f} tok/s ({len(prompts)} prompts x {a.new_tokens})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
