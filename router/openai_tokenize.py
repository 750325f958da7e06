"""`POST /tokenize` and `POST /detokenize`, as vLLM's server answers them: a text prompt, or chat
messages rendered by the checkpoint's template exactly as `/v1/chat/completions` renders them
(each image's placeholder expanded to its tokens), to the token ids the nodes would get; and ids
back to text. Clients count tokens with these before
they send (RL rollouts, context budgeting) without loading the tokenizer themselves."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from router.openai_models import I32, ChatRequest, bad, parse


class TokenizeText(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str
    return_token_strs: bool = False


class Detokenize(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=I32)]]


def register(app: FastAPI, front: Any, limit: int) -> None:
    """The two routes on `app`; `front` is the OpenAIFront (its tokenizer, model names, chat)."""
    from router.http_limits import read_json  # noqa: PLC0415 (beside the other routes' reader)

    service = front.service

    def tokenizer():
        if front.tok is None:
            raise bad("this router has no tokenizer (the checkpoint has no tokenizer.json)")
        return front.tok

    def served(name: str | None) -> None:
        if name is not None:
            front.model(name)  # 404 when no node serves it

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request, limit)
        tok = tokenizer()
        if isinstance(body, dict) and "messages" in body:
            chat = {k: v for k, v in body.items() if k not in ("return_token_strs", "add_special_tokens")}
            req = parse(ChatRequest, dict(chat, model=body.get("model") or "-"))
            assert isinstance(req, ChatRequest)
            served(body.get("model"))
            bounds = front.image_bounds(req)
            prep = await front.render(req)
            ids, strs = await service.encode(prep.prompt), bool(body.get("return_token_strs"))
            if prep.images:  # as vLLM's: each image's placeholder is its tokens, as many as its size makes
                ids, _ = service.images.expand(ids, await service.images.prepare(prep.images, bounds))
        else:
            t = parse(TokenizeText, body)
            assert isinstance(t, TokenizeText)
            served(t.model)
            ids, strs = await service.encode(t.prompt), t.return_token_strs
        ctx = max((m.max_model_len for m in service.models()), default=0)
        out = {"count": len(ids), "max_model_len": ctx, "tokens": ids}
        out["token_strs"] = [tok.id_to_token(i) for i in ids] if strs else None
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        d = parse(Detokenize, await read_json(request, limit))
        assert isinstance(d, Detokenize)
        tok = tokenizer()
        served(d.model)
        vocab = tok.vocab_size()
        bad_ids = [i for i in d.tokens if i >= vocab]
        if bad_ids:
            raise bad(f"token ids past the vocabulary ({vocab}): {bad_ids[:5]}", "tokens")
        # special tokens stay, as vLLM's: a /tokenize round trip gives the text back (a chat prompt's template too)
        return JSONResponse({"prompt": await service.text.decode(list(d.tokens), skip_special_tokens=False)})
