"""Prompt logprobs (`SamplingParams.prompt_logprobs`): for every prompt position whose next
token is known, that token's log-probability, its rank in the vocabulary and the n most likely
tokens, as vLLM reports them.

They are computed from the final hidden states ROWS positions at a time (head GEMM, float32
log-softmax, gather, rank, top-k), so a long prompt chunk never holds all its logits at once:
2,048 positions of a 151,936-token vocabulary are 1.2 GB of float32 logits, and as much again
for their log-softmax; ROWS of them are 155 MB."""

from __future__ import annotations

from collections.abc import Callable

import torch

ROWS = 256  # positions per head GEMM and log-softmax

# (token id, log-probability, [(id, log-probability) of the n most likely, most likely first],
#  rank of the token: 1 + how many tokens are strictly more likely)
PromptLogprob = tuple[int, float, list[tuple[int, float]], int]


def prompt_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: list[int], n: int
) -> list[PromptLogprob]:
    """hidden [len(targets), H]: the final (normed) hidden state at each position; targets: the
    token after each. One host read per ROWS positions; top ties go to the lower id."""
    out: list[PromptLogprob] = []
    for a in range(0, len(targets), ROWS):
        lsm = torch.log_softmax(head(hidden[a : a + ROWS]).float(), -1)
        t = torch.tensor(targets[a : a + ROWS], device=lsm.device)[:, None]
        got = lsm.gather(-1, t)
        cols = [got, (lsm > got).sum(-1, keepdim=True, dtype=torch.int32).to(lsm.dtype) + 1]  # below 2^24: exact
        if n:
            top = torch.topk(lsm, n, dim=-1)
            cols += [top.values, top.indices.to(lsm.dtype)]
        rows = torch.cat(cols, 1).double().tolist()
        del lsm
        for tok, r in zip(targets[a : a + ROWS], rows):
            out.append((tok, r[0], [(int(i), v) for v, i in zip(r[2 : 2 + n], r[2 + n : 2 + 2 * n])], int(r[1])))
    return out
