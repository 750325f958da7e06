"""The finished outputs `LLM.generate` returns: each request's whole logprobs (not its last
step's), its text, and vLLM's shape beside the engine's fields: `prompt`, `outputs` (one
`CompletionOutput` whose logprobs are vLLM's {token_id: Logprob} per position) and
`prompt_logprobs` as vLLM's (None for the first prompt token, then {token_id: Logprob})."""

from __future__ import annotations

import dataclasses

from engine.llm_text import Stopped
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


def each_completion(params: list[SamplingParams]) -> list[tuple[int, SamplingParams]]:
    """vLLM's `n`: (prompt index, params) per completion, each a request of its own with n 1; a
    seeded prompt's i-th completion is seeded seed + i, as vLLM seeds them."""
    out = []
    for i, sp in enumerate(params):
        for k in range(sp.n):
            seed = sp.seed + k if sp.seed is not None else None
            out.append((i, sp if sp.n == 1 else dataclasses.replace(sp, n=1, seed=seed)))
    return out


def by_prompt(outs: list[RequestOutput], rows: list[tuple[int, SamplingParams]]) -> list[RequestOutput]:
    """One RequestOutput per prompt: its first completion's, holding every completion of the prompt
    in `outputs` (index 0..n-1)."""
    grouped: dict[int, RequestOutput] = {}
    for out, (i, _) in zip(outs, rows):
        if i not in grouped:
            grouped[i] = out
        else:
            c = out.outputs[0]
            c.index = len(grouped[i].outputs)
            grouped[i].outputs.append(c)
    return [grouped[i] for i in sorted(grouped)]


def finish(
    out: RequestOutput,
    params: SamplingParams,
    prompt: str | None,
    logprobs: list,
    prompt_logprobs: list | None,
    tokenizer: Tokenizer | None,
    stopped: Stopped | None = None,
) -> RequestOutput:
    out.logprobs = logprobs if params.logprobs is not None else None
    out.prompt_logprobs = (
        [None, *_vllm_logprobs(prompt_logprobs or [], tokenizer)] if params.prompt_logprobs is not None else None
    )
    if stopped is not None:
        out.text = stopped.text
    elif tokenizer is not None:
        # a "stop" finish is its last token (EOS or a stop_token_ids entry): as vLLM's detokenizer,
        # its id stays and its text is left out unless include_stop_str_in_output
        shown = out.output_token_ids
        if out.finish_reason == "stop" and shown and not params.include_stop_str_in_output:
            shown = shown[:-1]
        out.text = tokenizer.decode(shown, params.skip_special_tokens) if params.detokenize else ""
    out.prompt = prompt
    ids = out.output_token_ids
    stop: int | str | None = stopped.stop if stopped is not None else None
    if stop is None and out.finish_reason == "stop" and ids and ids[-1] in params.stop_token_ids:
        stop = ids[-1]
    out.outputs = [
        CompletionOutput(
            index=0,
            text=out.text or "",
            token_ids=list(ids),
            cumulative_logprob=sum(lp for _, lp, _ in out.logprobs) if out.logprobs is not None else None,
            logprobs=_vllm_logprobs(out.logprobs, tokenizer) if out.logprobs is not None else None,
            finish_reason=out.finish_reason,
            stop_reason=stop,
        )
    ]
    return out


def _vllm_logprobs(entries: list, tokenizer: Tokenizer | None) -> list[dict[int, Logprob]]:
    """(token, logprob, [(id, logprob) most likely first][, rank]) per position -> {id: Logprob},
    the chosen token first; a top entry's rank is its place (1-based); the chosen token's is the
    engine's rank where it has one (prompt logprobs), else that place when it is among them,
    else None (output logprobs are not ranked)."""
    texts: dict[int, str | None] = {}

    def text(t: int) -> str | None:
        if t not in texts:
            texts[t] = None if tokenizer is None else tokenizer.decode([t], skip_special_tokens=False)
        return texts[t]

    out = []
    for e in entries:
        tok, lp, top = e[0], e[1], e[2]
        ranks = {t: r for r, (t, _) in enumerate(top, 1)}
        pos = {tok: Logprob(lp, e[3] if len(e) > 3 else ranks.get(tok), text(tok))}
        for r, (t, tlp) in enumerate(top, 1):
            pos.setdefault(t, Logprob(tlp, r, text(t)))
        out.append(pos)
    return out
