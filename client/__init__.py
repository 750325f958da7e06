"""pdserve client SDK: `Client` and `AsyncClient` talk to a router over gRPC (`generate`, `stream`,
`wait_ready`, `list_models`; images with `images=`; `chat` / `chat_stream` with OpenAI's chat body). Closing a stream cancels the request; failures raise `PdserveError`
with the gRPC code and message. README.md has the examples."""

from client.aio import AsyncClient, AsyncTokenStream
from client.chat import ChatChoice, ChatResult
from client.sync import Client, TokenStream
from client.types import IMAGE_PLACEHOLDER, GenerateResult, PdserveError, StreamChunk, TokenLogprob

__all__ = [
    "IMAGE_PLACEHOLDER",
    "AsyncClient",
    "AsyncTokenStream",
    "ChatChoice",
    "ChatResult",
    "Client",
    "GenerateResult",
    "PdserveError",
    "StreamChunk",
    "TokenLogprob",
    "TokenStream",
]
