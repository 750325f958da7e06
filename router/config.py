"""RouterConfig: what one router runs with (admission, policy, timeouts, ports).

Every field is an option of `pdserve router` (engine/options.py); `pdserve up` gives the router
all of them but the node lists and the host, which it sets itself. The image limits are ImageArgs
(router/images/config.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine import config_overrides
from engine import generation_defaults as gen_defaults
from engine.json_text import json_value
from engine.options import option
from router.admission import CLASS_NAMES
from router.images.config import ImageArgs
from router.policy import PolicyName, make_policy
from serving.config import SecurityArgs

ADMISSION_HELP = (
    "seconds a request may wait to start (its default budget; a request may send its own): one the router "
    "estimates could not start in time is refused RESOURCE_EXHAUSTED at arrival (0: wait as long as it takes)"
)


@dataclass(frozen=True)
class RouterConfig(ImageArgs, SecurityArgs):
    model: str | None = option(None, "checkpoint directory: its tokenizer serves text prompts")
    # read with the nodes' overrides: the router reads config.json's vision side (router/images/vision.py)
    hf_overrides: str | None = option(None, config_overrides.HELP)
    static_decode: tuple[str, ...] = option(
        (), "a static decode node, polled with Stats (repeatable)", flag="--decode", metavar="ADDR"
    )
    static_prefill: tuple[str, ...] = option(
        (), "a static prefill node, polled with Stats (repeatable)", flag="--prefill", metavar="ADDR"
    )
    heartbeat_interval_s: float = option(0.5, "seconds between node heartbeats (nodes are told to use it)")
    dead_after_s: float = option(3.0, "a node with no heartbeat for this many seconds is dead")
    # Admission (router/admission.py): decided at arrival against this budget; 30 s: a client that
    # says nothing is served when it can start within half a minute (time left to generate under a
    # one-minute client or balancer timeout), else hears no at once and can go elsewhere.
    admission_timeout_s: float = option(30.0, ADMISSION_HELP)
    # 1024: the largest completions request (64 prompts x n = 16) fits an idle router
    max_queued_requests: int = option(
        1024,
        "requests that may wait for admission ahead of a new one (its class and the classes before it); one "
        "more is refused RESOURCE_EXHAUSTED at once (0: no limit)",
    )
    # Beyond the window requests wait in the admission queue and reserve no decode memory. A prompt
    # larger than the window still goes to an idle node.
    prefill_window_tokens: int = option(
        8192,
        "prompt tokens the router keeps outstanding per prefill node (sent, first token not back); the rest "
        "wait in the admission queue without reserving decode memory (0: no window)",
    )
    policy: PolicyName = option("cache-aware", "routing policy")
    # cache-aware (router/policy.py): a node's price is the prompt tokens it must still compute plus
    # its queued prefill tokens plus this weight per KV token held by a decode node's running requests.
    prefix_load_weight: float = option(
        0.1, "cache-aware routing: prompt tokens of work one KV token held on a decode node counts for"
    )
    prefix_memory_s: float = option(
        10.0,
        "cache-aware routing: seconds the router counts a prompt it placed as cached on its nodes "
        "(until their prefix digest, a heartbeat behind, reports it)",
    )
    # The prefill node renews the lease every third of it while it works on the request, so it only
    # runs out when that node stops (dead or hung).
    reservation_lease_s: float = option(
        15.0,
        "seconds a decode reservation lives without a renewal; prefill nodes renew it while they work on "
        "the request, so it runs out only for a dead or hung prefill node",
    )
    prefill_timeout_s: float = option(
        120.0,
        "seconds one Prefill call (queue + compute + push) may take, plus twice its prompt's time at the "
        "prefill node's measured rate",
    )
    # The encode pool (docs/images.md): past this the prefill node encodes the images itself.
    encode_timeout_s: float = option(30.0, "seconds one Encode call (encode + push into the prefill node) may take")
    # Conditional disaggregation by load: counts a node's last report plus what the router sent since.
    max_prefill_queue_tokens: int = option(
        0,
        "when every prefill node has this many prompt tokens queued, decode nodes prefill new prompts "
        "themselves (0: no limit)",
    )
    # Mid-stream migration (router/migrate.py): a request whose decode node fails after it streamed
    # tokens continues on another decode node from the tokens sent, at most this many times.
    max_migrations: int = option(
        2, "times one request may move to another decode node when its node fails mid-stream (0: never)"
    )
    served_model_name: tuple[str, ...] = option(
        (),
        "a name clients call the model by (repeatable: aliases; the first is the id /v1/models lists); "
        "default: the checkpoint directory's name, ORG/NAME for a Hugging Face cache snapshot",
    )
    metrics_port: int | None = option(None, "Prometheus /metrics on this port (0 picks one; default off)")
    http_port: int | None = option(None, "OpenAI-compatible HTTP on this port (0 picks one; default off)")
    allowed_origins: tuple[str, ...] = option(
        ("*",),
        "an origin browsers may call the HTTP API from (CORS; repeatable; '*': any, as vLLM's default; "
        "'none': no CORS headers)",
    )
    host: str = option("127.0.0.1", "address the router binds (gRPC, metrics and HTTP)")
    # Client API keys (serving/security.py): none given, the client plane is open.
    api_key: tuple[str, ...] = option(
        (),
        "a client API key (repeatable; visible in the process list: prefer --api-key-file or PDSERVE_API_KEY)",
        secret=True,
    )
    api_key_file: str | None = option(
        None, "file of client API keys, one a line (PDSERVE_API_KEY adds more, comma-separated)"
    )
    max_requests_per_key: int = option(
        0, "requests one API key may have in flight; more are refused RESOURCE_EXHAUSTED / HTTP 429 (0: no limit)"
    )
    # Priority by key (docs/router.md, "Priorities"): a key's class is the highest its requests get;
    # a request's field or header may lower it, never raise it. A key is named by its id (the first
    # 8 hex digits of its SHA-256, as logs and metrics name it), so no secret is on the command line.
    api_key_priority: tuple[str, ...] = option(
        (),
        "an API key's class, KEY_ID=interactive|batch (KEY_ID: the first 8 hex digits of the key's SHA-256, as "
        "logs name it; repeatable): its requests are never above it; keys not named are interactive",
        metavar="KEY_ID=CLASS",
    )

    # The front door (router/http_limits.py): checked before a body is parsed or a prompt tokenized.
    # 16 MiB holds a full 262,144-token context as token ids several times over, or a text prompt
    # of max_prompt_chars; a 20 MB body is refused from its Content-Length, unread.
    max_body_bytes: int = option(
        16 << 20,
        "largest HTTP request body or gRPC message, in bytes, and most image bytes one request may carry; larger: "
        "refused (400 / INVALID_ARGUMENT; gRPC: RESOURCE_EXHAUSTED)",
    )
    max_prompt_chars: int = option(
        4 << 20,
        "longest text prompt (or chat messages), in characters, refused (400) before it is tokenized; prompts are "
        "also refused beyond 16 characters per token of the longest context a live decode node serves",
    )
    responses_store_mb: int = option(
        256,
        "memory, in MiB, for the /v1/responses this router keeps (store, previous_response_id); the least "
        "recently used go first (0: none kept, previous_response_id refused)",
    )
    tokenizer_workers: int = option(
        0, "threads that tokenize long prompts and detokenize long texts off the event loop (0: one per core, 2-8)"
    )

    # Chat output parsers (docs/api.md "Chat: the template's inputs, reasoning, tool calls"); auto: from the chat template's text
    reasoning_parser: Literal["auto", "think", "none", "qwen3", "deepseek_r1"] = option(
        "auto",
        "split <think>...</think> into reasoning_content (auto: when the chat template writes <think>; "
        "vLLM's qwen3 and deepseek_r1 are think)",
    )
    tool_call_parser: Literal["auto", "xml", "json", "none", "qwen3_coder", "qwen3_xml", "hermes"] = option(
        "auto",
        "tool-call format parsed out of chat output: xml (<function=NAME>, Qwen3.5), json (Qwen2.5 / Qwen3) "
        "(auto: from the chat template; vLLM's qwen3_coder and qwen3_xml are xml, hermes is json)",
    )
    chat_template: str = option(
        "",
        "a Jinja chat template, a file or the text itself, rendering every chat request instead of the "
        "checkpoint's (vLLM's --chat-template; empty: the checkpoint's)",
    )
    enable_auto_tool_choice: bool = option(
        True, "accepted for vLLM's command lines: tool_choice auto is always on (with tools)"
    )
    default_chat_template_kwargs: str | None = option(
        None,
        "a JSON object of chat template arguments every chat request gets unless it sends its own (vLLM's), "
        "e.g. '{\"enable_thinking\": false}' to answer without thinking by default",
    )
    return_tokens_as_token_ids: bool = option(
        False,
        "logprobs name their tokens as 'token_id:N' unless a request says otherwise (vLLM's; for clients that "
        "need ids where a token's text is not valid UTF-8 alone)",
    )
    enable_force_include_usage: bool = option(
        False, "every stream ends with a usage chunk, as if each request sent stream_options.include_usage (vLLM's)"
    )
    # engine/generation_defaults.py: applied to every request's unset sampling fields (router/service.py)
    generation_config: str = option("auto", gen_defaults.HELP)
    override_generation_config: str | None = option(None, gen_defaults.OVERRIDE_HELP)

    def __post_init__(self):
        # vLLM's parser names, as users copy them from its command lines
        named = {"qwen3": "think", "deepseek_r1": "think", "qwen3_coder": "xml", "qwen3_xml": "xml", "hermes": "json"}
        object.__setattr__(self, "reasoning_parser", named.get(self.reasoning_parser, self.reasoning_parser))
        object.__setattr__(self, "tool_call_parser", named.get(self.tool_call_parser, self.tool_call_parser))
        self.check_security()
        config_overrides.parse(self.hf_overrides)  # not an object: one line, before anything starts
        self.check_images()
        self.chat_template_text()  # read and compiled now: a bad one stops the start
        self.template_kwargs  # noqa: B018  (an object, or one line)
        self.sampling_defaults  # noqa: B018  (read and checked now, as vLLM reads generation_config.json at start)
        if self.max_body_bytes < 1024 or self.max_prompt_chars < 1 or self.tokenizer_workers < 0:
            raise ValueError("max_body_bytes must be >= 1024, max_prompt_chars >= 1, tokenizer_workers >= 0")
        if self.responses_store_mb < 0:
            raise ValueError(f"responses_store_mb must be >= 0 (got {self.responses_store_mb})")
        if self.max_requests_per_key < 0:
            raise ValueError("max_requests_per_key must be >= 0 (0: no limit)")
        if self.dead_after_s <= self.heartbeat_interval_s:
            raise ValueError("dead_after_s must exceed heartbeat_interval_s")
        if self.admission_timeout_s < 0:
            raise ValueError("admission_timeout_s must be >= 0")
        if self.max_queued_requests < 0 or self.prefill_window_tokens < 0:
            raise ValueError("max_queued_requests and prefill_window_tokens must be >= 0 (0: no limit)")
        if self.reservation_lease_s <= 0:
            raise ValueError(f"reservation_lease_s must be positive (got {self.reservation_lease_s})")
        if self.max_prefill_queue_tokens < 0:
            raise ValueError("max_prefill_queue_tokens must be >= 0 (0: no limit)")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0 (got {self.max_migrations})")
        if self.prefix_load_weight < 0 or self.prefix_memory_s < 0:
            raise ValueError("prefix_load_weight and prefix_memory_s must be >= 0")
        make_policy(self.policy)
        self.key_classes  # noqa: B018  (checks the entries)

    def chat_template_text(self) -> str:
        """--chat-template's text ("" for the checkpoint's): a file's content, or the value itself
        when it holds Jinja; ValueError for neither, or for a template that does not compile."""
        v = self.chat_template
        if not v:
            return ""
        path = Path(v).expanduser()
        if "{{" not in v and "{%" not in v:
            try:
                v = path.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(
                    f"--chat-template {self.chat_template!r}: not a readable file ({e}) nor a template"
                ) from None
        from router.chat_template import ChatTemplate

        try:
            ChatTemplate(v)
        except Exception as e:  # jinja2's TemplateSyntaxError and kin
            raise ValueError(f"--chat-template {self.chat_template[:80]!r} does not compile: {e}") from None
        return v

    @property
    def template_kwargs(self) -> dict:
        """--default-chat-template-kwargs as a dict ({} for none); ValueError, one line, for other than an object."""
        if not self.default_chat_template_kwargs:
            return {}
        v = json_value(self.default_chat_template_kwargs, "--default-chat-template-kwargs")
        if not isinstance(v, dict):
            raise ValueError(
                f'--default-chat-template-kwargs must be a JSON object, such as {{"enable_thinking": false}} (got {v!r:.60})'
            )
        return v

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """The default sampling parameters (engine/generation_defaults.py), read from the checkpoint."""
        return gen_defaults.defaults(self.model, self.generation_config, self.override_generation_config)

    @property
    def key_classes(self) -> dict[str, int]:
        """API key id -> the highest class its requests get (0 interactive, 1 batch)."""
        out = {}
        for e in self.api_key_priority:
            kid, _, cls = e.partition("=")
            kid, cls = kid.strip().lower(), cls.strip().lower()
            if not re.fullmatch(r"[0-9a-f]{8}", kid) or cls not in CLASS_NAMES:
                raise ValueError(
                    f"--api-key-priority {e!r}: expected KEY_ID=CLASS, KEY_ID the key's 8 hex digit id, "
                    f"CLASS one of {', '.join(CLASS_NAMES)}"
                )
            out[kid] = CLASS_NAMES.index(cls)
        return out
