"""Chat over gRPC (`Generation.Chat`, for the SDK's `Client.chat`): an OpenAI chat completions
body served by the HTTP chat path's own code (router/openai_api.py `OpenAIFront`: the template,
the constraint, the output parsers), each choice's chunks (with the tokens they carry) and then
the usage sent as JSON in ChatChunk messages. A request that resumes (the SDK after its router
failed) continues each choice after the tokens its client has. A refusal ends the call with the
gRPC status of its HTTP one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

import grpc

from proto import pb
from router.openai_api import OpenAIFront
from router.openai_choices import Choice, Job, usage
from router.openai_models import ApiError, ChatRequest, parse

# an HTTP refusal's status as gRPC's (the inverse of openai_models' mapping, for what the chat path raises)
GRPC_OF = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


async def chat_chunks(
    front: OpenAIFront, body_json: str, resume: Sequence[pb.ChatResume] = ()
) -> AsyncIterator[pb.ChatChunk]:
    """The answer to `body_json` as ChatChunks (ApiError or Abort before or while it streams);
    `resume`: the SDK's choices so far, on a router after the one that failed."""
    try:
        body = json.loads(body_json)
    except ValueError as e:
        raise ApiError(400, f"body_json is not JSON: {e}", param="body_json") from None
    req = parse(ChatRequest, body)
    assert isinstance(req, ChatRequest)
    job = await front.job(req)
    choices = [Choice(job, i, front.tok) for i in range(len(job.reqs))]
    only = await _resumed(front, job, choices, resume) if resume else None
    async with aclosing(front.events(job, only)) as ev:
        async for i, c in ev:
            d = choices[i].delta(c)
            if d is not None:
                yield pb.ChatChunk(choice_json=json.dumps(d), token_ids=c.token_ids)
    yield pb.ChatChunk(usage_json=json.dumps(usage(choices)))


async def _resumed(front: OpenAIFront, job: Job, choices: list[Choice], resume: Sequence[pb.ChatResume]) -> list[int]:
    """Each resumed choice's tokens become its request's output so far (resume_token_ids) and go
    through its parsers unsent; returns the choices to continue (those not finished)."""
    got: dict[int, pb.ChatResume] = {}
    for r in resume:
        if r.index >= len(choices) or r.index in got:
            raise ApiError(400, f"resume: choice {r.index} is not one of this answer's {len(choices)}", param="resume")
        got[r.index] = r
    prompt = await front.service.prompt_ids(job.reqs[0], job.images)  # one prompt for every choice
    for i, r in got.items():
        if r.token_ids:
            job.reqs[i].resume_token_ids.extend(r.token_ids)
        choices[i].replay(list(r.token_ids), r.finished, prompt)
    return [i for i in range(len(choices)) if not (i in got and got[i].finished)]
