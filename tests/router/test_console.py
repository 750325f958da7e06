"""A status line reaches the console in one write, so another writer sharing the pipe (a log line
from a thread or a child process) cannot land between its text and its newline."""

import io

from router.console import say


class Writes(io.StringIO):
    """A stream that records each write it gets, as an unbuffered pipe would pass each on."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_a_line_and_its_newline_are_one_write():
    out = Writes()
    say("pdserve up: ready at 127.0.0.1:41713", out)
    assert out.writes == ["pdserve up: ready at 127.0.0.1:41713\n"]
    ref = Writes()
    print("pdserve up: ready at 127.0.0.1:41713", file=ref, flush=True)  # what the line was written with
    assert ref.getvalue() == out.getvalue() and len(ref.writes) == 2
