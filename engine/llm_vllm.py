"""vLLM's offline spellings that the `LLM` takes beside its own (docs/engine.md, "engine/llm.py"):
the constructor's `speculative_config`, `enforce_eager`, `trust_remote_code` and
`limit_mm_per_prompt`, and `chat`'s rendering of conversations with the checkpoint's chat
template (through transformers' tokenizer, as vLLM renders them). `speculative` is also how the
command line and pools files read vLLM's speculative config (router/vllm_flags.py)."""

from __future__ import annotations

from typing import Any

from engine.json_text import json_value

MTP = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")
SPEC_KEYS = ("method", "num_speculative_tokens")
MODALITIES = ("image", "video")


def speculative(spec: object, where: str = "--speculative-config") -> dict[str, str | int]:
    """vLLM's speculative config (a JSON object on the command line, a mapping or its JSON text in
    a pools file or `LLM(speculative_config=...)`) as pdserve's options: {"speculative_method":
    ..., "num_speculative_tokens": ...}, each if given."""
    spec = json_value(spec, where)
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be a JSON object")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"{where}: {', '.join(unknown)} not supported (supported: {', '.join(SPEC_KEYS)})")
    out: dict[str, str | int] = {}
    method = spec.get("method")
    if method is not None:
        if method in MTP:
            method = "mtp"
        elif method not in ("ngram",):
            raise ValueError(f"{where} method {method!r}: pdserve drafts with {', '.join(MTP)} or ngram")
        out["speculative_method"] = method
    n = spec.get("num_speculative_tokens")
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{where} num_speculative_tokens must be an integer >= 0 (got {n!r})")
        out["num_speculative_tokens"] = n
    return out


def mm_limits(limit: Any) -> dict[str, int]:
    """vLLM's `limit_mm_per_prompt` ({"image": N, "video": N}) checked: a ValueError naming it
    for another modality or a count that is not an integer >= 0."""
    if limit is None:
        return {}
    if not isinstance(limit, dict):
        raise ValueError(f"limit_mm_per_prompt must be a dict such as {{'image': 2}} (got {type(limit).__name__})")
    out: dict[str, int] = {}
    for k, v in limit.items():
        if k not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {k!r} (known: {', '.join(MODALITIES)})")
        if isinstance(v, dict):  # vLLM's newer form, {"image": {"count": N, ...}}
            v = v.get("count")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"limit_mm_per_prompt[{k!r}] must be an integer >= 0 (got {v!r})")
        out[k] = v
    return out


def check_image_counts(limits: dict[str, int], counts: list[int]) -> None:
    """ValueError naming the prompt whose images are more than `limit_mm_per_prompt` allows."""
    if "image" not in limits:
        return
    for i, n in enumerate(counts):
        if n > limits["image"]:
            raise ValueError(f"prompt {i}: {n} images; limit_mm_per_prompt allows {limits['image']} per prompt")


def conversations(messages: Any) -> list[list[dict]]:
    """`chat`'s messages: one conversation (a list of message dicts) or a list of them."""
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        return [messages]
    if isinstance(messages, list) and messages and all(isinstance(c, list) for c in messages):
        for k, c in enumerate(messages):
            if not c or not all(isinstance(m, dict) for m in c):
                raise ValueError(f"conversation {k}: expected a non-empty list of message dicts")
        return messages
    raise ValueError("messages must be a list of message dicts or a list of such conversations")


def render_chat(
    tokenizer: Any,
    convs: list[list[dict]],
    *,
    tools: list[dict] | None,
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None,
) -> list[str]:
    """Each conversation rendered to its prompt text by the checkpoint's chat template (or
    `chat_template`), with vLLM's switches; ValueError naming the conversation otherwise."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    kw = dict(chat_template_kwargs or {})
    clash = sorted(set(kw) & {"tools", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize"})
    if clash:
        raise ValueError(f"chat_template_kwargs: {', '.join(clash)} is an argument of chat itself")
    out = []
    for k, conv in enumerate(convs):
        for j, m in enumerate(conv):
            parts = m.get("content")
            if isinstance(parts, list) and any(isinstance(p, dict) and p.get("type") != "text" for p in parts):
                raise ValueError(
                    f"conversation {k} message {j}: only text parts are rendered by chat; give images to "
                    "generate as multi_modal_data (docs/engine.md)"
                )
        try:
            text = tokenizer.apply_chat_template(
                conv,
                tools=tools,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **kw,
            )
        except Exception as e:  # noqa: BLE001 (jinja's and transformers' errors alike, named here)
            raise ValueError(f"conversation {k}: the chat template failed: {e}") from None
        out.append(text)
    return out
