"""Where a sampler call's time goes on CUDA: batch 64 x 151,936 with Qwen's chat settings (new
rows, then running rows), the profiler's ops by host time and by GPU time."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine.sampling import Sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.step import RowInput  # noqa: E402


def main() -> None:
    B, V = 64, 151_936
    logits = torch.randn(B, V, device="cuda") * 4
    chat = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)
    for running in (False, True):
        s = Sampler(device="cuda")
        rows = [
            RowInput(
                f"r{b}",
                [7],
                40,
                0,
                [],
                True,
                True,
                params=SamplingParams(**chat, seed=b),
                num_draft=0,
                history=(list(range(40)), []),
                num_output=0,
            )
            for b in range(B)
        ]

        def call():
            emitted, _ = s(logits.clone(), rows, list(range(B)))
            if running:
                for r, toks in zip(rows, emitted):
                    r.history[1].append(toks[0])
                    r.num_output += 1

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as prof:
            for _ in range(10):
                call()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(f"== running={running}: per 10 calls", flush=True)
        print(ka.table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=60))
        print(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
