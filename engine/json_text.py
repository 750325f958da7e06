"""JSON given as text or as the value it spells: vLLM's options (`--hf-overrides`,
`--speculative-config`, `structured_outputs.json`) come as JSON text on a command line and as
mappings in a pools file or a Python call. Imports no torch."""

from __future__ import annotations

import json
from typing import Any


def json_value(value: Any, where: str) -> Any:
    """`value` parsed when it is text, else as given; ValueError, one line naming `where`, for
    text that is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON: {e}") from None
