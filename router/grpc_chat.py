"""Chat over gRPC (`Generation.Chat`, for the SDK's `Client.chat`): an OpenAI chat completions
body served by the HTTP chat path's own code (router/openai_api.py `OpenAIFront`: the template,
the constraint, the output parsers), each choice's chunks and then the usage sent as JSON in
ChatChunk messages. A refusal ends the call with the gRPC status of its HTTP one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from proto import pb
from router.openai_api import OpenAIFront
from router.openai_choices import Choice, usage
from router.openai_models import ApiError, ChatRequest, parse

# an HTTP refusal's status as gRPC's (the inverse of openai_models' mapping, for what the chat path raises)
GRPC_OF = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


async def chat_chunks(front: OpenAIFront, body_json: str) -> AsyncIterator[pb.ChatChunk]:
    """The answer to `body_json` as ChatChunks (ApiError or Abort before or while it streams)."""
    try:
        body = json.loads(body_json)
    except ValueError as e:
        raise ApiError(400, f"body_json is not JSON: {e}", param="body_json") from None
    req = parse(ChatRequest, body)
    assert isinstance(req, ChatRequest)
    job = await front.job(req)
    choices = [Choice(job, i, front.tok) for i in range(len(job.reqs))]
    async with aclosing(front.events(job)) as ev:
        async for i, c in ev:
            d = choices[i].delta(c)
            if d is not None:
                yield pb.ChatChunk(choice_json=json.dumps(d))
    yield pb.ChatChunk(usage_json=json.dumps(usage(choices)))
