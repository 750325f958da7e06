"""Status lines on the console, each reaching it whole.

`print` writes a line's text and its newline separately; with PYTHONUNBUFFERED (or any unbuffered
stream) they are two writes, and a log line from another thread or a child process sharing the
pipe can land between them, so a reader parsing "ready at ADDR" reads the address joined to a
timestamp. `say` writes the line and its newline at once."""

from __future__ import annotations

import sys
from typing import TextIO


def say(line: str, out: TextIO | None = None) -> None:
    """Write `line` and its newline in one write, then flush."""
    out = out if out is not None else sys.stdout
    out.write(line + "\n")
    out.flush()
