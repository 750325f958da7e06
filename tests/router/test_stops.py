"""Stop strings across a resume (router/stops.py): a stream cut anywhere and resumed with a
matcher primed by `held_back` sends exactly the text an uncut stream sends, against a naive
reference (the whole text cut before its first stop string)."""

from __future__ import annotations

import asyncio
import random
import time

from router.request import Chunk
from router.stops import MAX_STOP_CHARS, MAX_STOPS, StopMatcher, held_back, with_stops


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


def _naive_held(text: str, stops: list[str]) -> str:
    """The longest tail of `text` that begins a stop string (without completing it)."""
    return max((text[i:] for i in range(len(text)) if any(s.startswith(text[i:]) for s in stops)), key=len, default="")


def test_many_stop_strings_hold_back_and_cut_as_a_naive_reference():
    """Each push holds back exactly the longest tail that may begin a stop string (each stop
    string's search resumes from its own tail: it must still find every one)."""
    rng = random.Random(1)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 8))]
        pieces = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 12))]
        m, seen, sent = StopMatcher(stops), "", ""
        for p in pieces:
            seen += p
            out, hit = m.push(p)
            sent += out
            if hit:
                assert (sent, True) == _naive(seen, stops) and not _naive(seen[: -len(p) or None], stops)[1]
                break
            assert sent + m.held == seen and m.held == _naive_held(seen, stops), (stops, pieces)


def test_matching_at_the_bounds_is_not_quadratic_in_the_stop_strings_length():
    """MAX_STOPS strings of MAX_STOP_CHARS characters, against the output that makes a naive
    matcher rescan every tail (one string keeps a long one held, the others begin with it): a chunk
    costs about the same as with short strings, far from milliseconds on the router's loop."""
    n, long = MAX_STOP_CHARS, "a" * (MAX_STOP_CHARS - 1)
    stops = [long + "z"] + [("ab" * n)[:n] for _ in range(MAX_STOPS - 1)]
    m = StopMatcher(stops)
    for _ in range(n):
        m.push("a")
    t0 = time.perf_counter()
    for _ in range(1000):
        assert m.push("a")[1] is False
    per_chunk = (time.perf_counter() - t0) / 1000
    assert m.held == long and per_chunk < 1e-3, per_chunk  # the naive scan took several ms per chunk


def test_a_stop_inside_a_multi_token_chunk_cuts_the_tokens_after_it():
    """A step that accepted drafts sends several tokens in one chunk: a stop string completed by
    one of them ends the output at that token (ids, logprobs and so usage), as a stream of one
    token a chunk would, against the naive reference (the first token whose text completes it)."""
    rng = random.Random(2)
    for _ in range(300):
        pieces = ["".join(rng.choice("ab ") for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 10))]
        stops = [rng.choice(["ab a", "b b", "bb", "a", "zz"]) for _ in range(rng.randint(1, 2))]
        text, hit = _naive("".join(pieces), stops)
        want_n = next((n for n in range(1, len(pieces) + 1) if _naive("".join(pieces[:n]), stops)[1]), len(pieces))
        cuts = sorted(rng.sample(range(1, len(pieces)), rng.randint(0, len(pieces) - 1)))

        async def chunks(cuts=cuts, pieces=pieces):
            for a, b in zip([0, *cuts], [*cuts, len(pieces)]):
                last = b == len(pieces)
                yield Chunk(
                    token_ids=list(range(a, b)),
                    text="".join(pieces[a:b]),
                    finish_reason="length" if last else "",
                    logprobs=[f"lp{i}" for i in range(a, b)],
                    token_text=pieces[a:b] if b - a > 1 else (),
                )

        dropped = []

        async def run(chunks=chunks, stops=stops, dropped=dropped):
            return [c async for c in with_stops(chunks(), stops, on_stop=lambda *k: dropped.extend(k))]

        out = asyncio.run(run())
        ids = [t for c in out for t in c.token_ids]
        assert "".join(c.text for c in out) == text and (out[-1].finish_reason == "stop") == hit
        assert ids == list(range(want_n)), (pieces, stops, cuts)
        assert [lp for c in out for lp in c.logprobs] == [f"lp{i}" for i in ids]
        end = next(b for b in [*cuts, len(pieces)] if b >= want_n)  # of the chunk that completed it
        assert sum(dropped) == (end - want_n if hit else 0)
