"""vLLM's `truncate_prompt_tokens` on the completions and chat routes: the prompt the model sees is
the last N tokens of the one sent (chat: of the rendered conversation), -1 meaning the largest
`max_model_len` a live decode node serves. The cut is made on the router, before the request goes
to the nodes, so everything after it (usage's prompt_tokens, echo, logprobs with echo,
prompt_logprobs, return_token_ids' prompt_token_ids, the prefix cache) is about the kept tokens."""

from __future__ import annotations

from proto import pb
from router.openai_models import bad

FIELD = "truncate_prompt_tokens"


def context_len(service) -> int:
    """The largest max_model_len over the live decode nodes (0: none live)."""
    return max((e.info.max_model_len for e in service.registry.live(pb.NODE_KIND_DECODE)), default=0)


def kept_tokens(req, service, images: bool) -> int | None:
    """How many prompt tokens a body keeps: None (all) when it does not ask; a 400 naming the field
    for 0, below -1, more than max_model_len, or a prompt with images (an image's tokens are one
    block the model needs whole)."""
    n = getattr(req, FIELD, None)
    if n is None:
        return None
    if n == 0 or n < -1:
        raise bad(f"'{FIELD}' must be -1 (the model's max_model_len) or a positive integer (got {n})", FIELD)
    ctx = context_len(service)
    if ctx and n > ctx:
        raise bad(f"'{FIELD}' ({n}) cannot be greater than max_model_len ({ctx})", FIELD)
    if images:
        raise bad(f"'{FIELD}' cannot cut a prompt with images", FIELD)
    return (ctx or None) if n == -1 else n


async def truncated(service, prompt: str | list[int], keep: int) -> list[int]:
    """The last `keep` token ids of a prompt (text is tokenized as the router tokenizes any prompt)."""
    ids = list(prompt) if isinstance(prompt, list) else await service.encode(prompt)
    return ids[-keep:]
