"""The tiny checkpoint's tokens and chat template (engine/tiny_model.py): Qwen's added tokens and
a Jinja2 template written here that renders tools, tool calls, tool results, thinking and image or
video parts in the layout Qwen3.5's published template uses, so the router's template inputs and
output parsers (docs/api.md) are tested on a checkpoint shaped like the real ones. Qwen3-Next's
checkpoints write their calls as Qwen3's did, one JSON object each (`<tool_call>\\n{"name": NAME,
"arguments": {...}}\\n</tool_call>`): `CHAT_TEMPLATE_JSON_CALLS`, the same template with that
call layout.

Layout: tools are listed as JSON lines inside `<tools>` in the system turn; an assistant's calls
are `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
(string values raw, others as JSON); tool results are `<tool_response>` blocks in one user turn;
the generation prompt opens `<think>\\n`, or with `enable_thinking` false adds an empty, closed
think block; an assistant turn after the last user turn keeps its `reasoning_content`.
"""

from __future__ import annotations

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added after training, as Qwen's tokenizer has them: text tokens (kept by decode) and vision
# tokens (special: decode skips them)
TEXT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

_PARTS = """
{%- macro text_of(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content -%}
{%- for part in content -%}
{%- if part.type == 'text' -%}{{- part.text -}}
{%- elif part.type in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif part.type in ('video', 'video_url') -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- else -%}{{- raise_exception('a content part of type ' ~ part.type ~ ' has no rendering') -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
"""

_SYSTEM = """
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if has_system or tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if has_system -%}{{- text_of(messages[0].content) -}}{%- endif -%}
{%- if tools -%}
{%- if has_system -%}{{- '\\n\\n' -}}{%- endif -%}
{{- '# Functions\\n\\nYou may call these functions, each described by one JSON object:\\n<tools>' -}}
{%- for t in tools -%}{{- '\\n' ~ (t | tojson) -}}{%- endfor -%}
@@HOW_TO_CALL@@
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
"""

_TURNS = """
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role in ('system', 'user') -%}
{{- '<|im_start|>' ~ m.role ~ '\\n' ~ text_of(m.content) ~ '<|im_end|>\\n' -}}
{%- elif m.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if loop.index0 > ns.last_user and m.reasoning_content is string -%}
{{- '<think>\\n' ~ m.reasoning_content.strip() ~ '\\n</think>\\n\\n' -}}
{%- endif -%}
{{- text_of(m.content) -}}
{%- for c in m.tool_calls or [] -%}
{%- set f = c.function if c.function is defined else c -%}
{%- if not loop.first or m.content -%}{{- '\\n' -}}{%- endif -%}
@@CALL@@
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' ~ text_of(m.content) ~ '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- else -%}{{- raise_exception('unknown role ' ~ m.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- else -%}{{- '<think>\\n' -}}
{%- endif -%}
{%- endif -%}
"""

_XML_HOW = """{{- '\\n</tools>\\n\\nTo call functions, answer with calls only, each written as:\\n'
    '<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>\\n'
    'with one parameter block per argument and every required argument given.' -}}"""
_XML_CALL = """{{- '<tool_call>\\n<function=' ~ f.name ~ '>\\n' -}}
{%- if f.arguments is mapping -%}
{%- for k, v in f.arguments.items() -%}
{{- '<parameter=' ~ k ~ '>\\n' -}}
{%- if v is string -%}{{- v -}}{%- else -%}{{- v | tojson -}}{%- endif -%}
{{- '\\n</parameter>\\n' -}}
{%- endfor -%}
{%- endif -%}
{{- '</function>\\n</tool_call>' -}}"""
# Qwen3-Next's (and Qwen3's) published layout: one JSON object a call
_JSON_HOW = """{{- '\\n</tools>\\n\\nTo call a function, answer with one JSON object a call, its name and its '
    'arguments, between the call tags:\\n<tool_call>\\n{\"name\": NAME, \"arguments\": {...}}\\n</tool_call>' -}}"""
_JSON_CALL = """{{- '<tool_call>\\n{\"name\": ' ~ (f.name | tojson) ~ ', \"arguments\": ' -}}
{%- if f.arguments is string -%}{{- f.arguments -}}{%- else -%}{{- f.arguments | tojson -}}{%- endif -%}
{{- '}\\n</tool_call>' -}}"""


def _template(how: str, call: str) -> str:
    return (_PARTS + _SYSTEM.replace("@@HOW_TO_CALL@@", how) + _TURNS.replace("@@CALL@@", call)).strip()


CHAT_TEMPLATE = _template(_XML_HOW, _XML_CALL)  # Qwen3.5's calls
CHAT_TEMPLATE_JSON_CALLS = _template(_JSON_HOW, _JSON_CALL)  # Qwen3-Next's
