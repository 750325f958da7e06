"""NIXL's Python API, imported with its logger joined to the process's: NIXL gives its `nixl`
logger a handler of its own at import (its own format, INFO whatever level the process logs at).
Here that handler goes and its lines pass through the process's handlers: WARNING and above, or
everything when the process logs at DEBUG; NIXL_LOG_LEVEL, when set, keeps NIXL's own choice."""

from __future__ import annotations

import logging
import os
from typing import Any


def nixl_api() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config), NIXL's logger adopted (see the module docstring)."""
    from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415

    lg = logging.getLogger("nixl")
    if lg.handlers or lg.propagate is False:
        lg.handlers.clear()
        lg.propagate = True
        if not os.environ.get("NIXL_LOG_LEVEL"):
            debug = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
            lg.setLevel(logging.DEBUG if debug else logging.WARNING)
    return nixl_agent, nixl_agent_config
