"""Stop strings across a resume (router/stops.py): a stream cut anywhere and resumed with a
matcher primed by `held_back` sends exactly the text an uncut stream sends, against a naive
reference (the whole text cut before its first stop string)."""

from __future__ import annotations

import asyncio
import random

from router.request import Chunk
from router.stops import held_back, with_stops


def _stream(pieces: list[str], stops: list[str], held: str = "", ends: bool = True) -> tuple[str, bool]:
    """The text `with_stops` sends of chunks of `pieces` (the last finishes the stream if `ends`),
    and whether a stop string ended it."""

    async def chunks():
        for i, p in enumerate(pieces):
            yield Chunk(token_ids=[i], text=p, finish_reason="length" if ends and i == len(pieces) - 1 else None)

    async def run() -> tuple[str, bool]:
        out = [c async for c in with_stops(chunks(), stops, held=held)]
        return "".join(c.text for c in out), bool(out) and out[-1].finish_reason == "stop"

    return asyncio.run(run())


def _naive(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def test_a_stream_resumed_anywhere_sends_what_an_uncut_one_does():
    rng = random.Random(0)
    for _ in range(300):
        pieces = ["".join(rng.choice("ab\n ") for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 10))]
        stops = [rng.choice(["ab a", "\n\n", "bb", "a b\nx", "zz"]) for _ in range(rng.randint(1, 2))]
        want = _naive("".join(pieces), stops)
        assert _stream(pieces, stops) == want
        for cut in range(1, len(pieces)):
            before, hit = _stream(pieces[:cut], stops, ends=False)  # the router that failed
            if hit:  # it ended before the cut: nothing to resume
                continue
            got = held_back("".join(pieces[:cut]), stops)  # what the client lacks of the first part
            assert "".join(pieces[:cut]) == before + got
            after, hit = _stream(pieces[cut:], stops, got)
            assert (before + after, hit) == want, (pieces, stops, cut)
