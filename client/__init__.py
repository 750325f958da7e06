"""pdserve client SDK: talk to a router over gRPC.

    from client import Client, AsyncClient
    c = Client("127.0.0.1:50051")
    c.wait_ready(timeout=60)
    r = c.generate(prompt_token_ids=[1, 2, 3], max_tokens=32, temperature=0.0, ignore_eos=True)
    r.token_ids, r.text, r.finish_reason, r.ttft_s
    for chunk in c.stream(prompt="hello", max_tokens=32):
        chunk.token_ids

Closing a stream (or leaving its `with` block, or breaking out and dropping it) cancels the
request on the server. Failures raise `PdserveError` with the gRPC `code` and the server's message.
"""

from client.aio import AsyncClient, AsyncTokenStream
from client.sync import Client, TokenStream
from client.types import GenerateResult, PdserveError, StreamChunk, TokenLogprob

__all__ = [
    "AsyncClient",
    "AsyncTokenStream",
    "Client",
    "GenerateResult",
    "PdserveError",
    "StreamChunk",
    "TokenLogprob",
    "TokenStream",
]
