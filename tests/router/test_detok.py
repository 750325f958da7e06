"""The router's incremental detokenizer (router/detok.py): over token ids that split characters
(the byte tokens a sampling model writes: the tiny checkpoint's tokenizer, random ids, and text
with multi-byte characters), what it has emitted after any split into pushes is the text
transformers' tokenizer decodes from all the ids so far, less a trailing incomplete character;
so a detokenizer primed with one push of a stream's tokens goes on exactly as the one that
streamed them (a resumed stream's text has no gap and no repeat)."""

from __future__ import annotations

import random

import pytest

from engine.tiny_model import TinyModelSpec, make_tiny_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("detok") / "ckpt", TinyModelSpec(layers=1, hidden=64))
    return AutoTokenizer.from_pretrained(path)


def _streams(hf) -> list[list[int]]:
    rng = random.Random(3)
    texts = ["naïve café — Жизнь 你好世界 🙂🚀 done", "a€b€c€ 😀 end", "Привет, мир! " * 3]
    out = [hf.encode(t, add_special_tokens=False) for t in texts]
    out += [[rng.randrange(0, 606) for _ in range(40)] for _ in range(20)]  # a random model's output
    return out


def _pushed(tok, ids: list[int], cuts: list[int], final: bool) -> str:
    from router.detok import IncrementalDetokenizer

    d = IncrementalDetokenizer(tok)
    bounds = [0, *cuts, len(ids)]
    return "".join(d.push(ids[a:b], final=final and b == len(ids)) for a, b in zip(bounds, bounds[1:], strict=False))


def test_what_is_emitted_does_not_depend_on_the_pushes(hf):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(hf.name_or_path)
    rng = random.Random(5)
    split_chars = 0
    for ids in _streams(hf):
        for end in range(1, len(ids) + 1):
            want = hf.decode(ids[:end], skip_special_tokens=True)
            split_chars += want.endswith("\ufffd")
            part = ids[:end]
            for _ in range(3):
                cuts = sorted(rng.sample(range(1, end), min(end - 1, rng.randrange(0, 6)))) if end > 1 else []
                assert _pushed(tok, part, cuts, final=True) == want, (part, cuts)
                assert _pushed(tok, part, cuts, final=False) == want.rstrip("\ufffd"), (part, cuts)
            assert _pushed(tok, part, list(range(1, end)), final=False) == want.rstrip("\ufffd")  # a token a push
    assert split_chars > 10  # the streams did end inside characters


def test_a_primed_detokenizer_goes_on_as_the_one_that_streamed(hf):
    from engine.tokenizer import Tokenizer
    from router.detok import IncrementalDetokenizer

    tok = Tokenizer(hf.name_or_path)
    for ids in _streams(hf):
        for k in range(1, len(ids)):
            first = IncrementalDetokenizer(tok)  # streamed a token at a time, up to k
            sent = "".join(first.push([t]) for t in ids[:k])
            primed = IncrementalDetokenizer(tok)  # the next router: one push of the k tokens
            assert primed.push(ids[:k]) == sent
            rest = "".join(primed.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids[k:], k))
            assert sent + rest == hf.decode(ids, skip_special_tokens=True), k


@pytest.mark.parametrize("include", [False, True], ids=["left_out", "included"])
def test_a_stop_token_in_a_step_of_several_tokens(hf, include):
    """A decode step that accepted drafts ends on a stop token (the node's finish "stop"), with stop
    strings set (each token's text kept apart for their cut): the stop token's text is left out
    unless include_stop_str_in_output, as vLLM's detokenizer leaves it, and a character the tokens
    before it left incomplete comes out as transformers decodes it."""
    from engine.tokenizer import Tokenizer
    from proto import pb
    from router.detok import IncrementalDetokenizer
    from router.request import Chunk, RequestRun

    tok = Tokenizer(hf.name_or_path)
    ids = hf.encode("ab 你好", add_special_tokens=False)
    split = next(k for k in range(1, len(ids)) if hf.decode(ids[:k]).endswith("\ufffd"))  # inside a character
    stop = hf.encode("xyz", add_special_tokens=False)[0]
    for first, rest in (([], ids[:split] + [stop]), (ids[:1], ids[1:split] + [stop])):
        run = object.__new__(RequestRun)
        run.request = pb.GenerateRequest(
            sampling=pb.SamplingParams(stop=["never"], stop_token_ids=[stop], include_stop_str_in_output=include)
        )
        run.detok = IncrementalDetokenizer(tok)
        sent = run.detok.push(first)
        c = Chunk(token_ids=rest)
        run._text(c, rest, "stop")
        assert sent + c.text == hf.decode(first + rest if include else first + rest[:-1])
        assert len(c.token_text) == len(rest) and "".join(c.token_text) == c.text
        assert c.token_text[-1].endswith(hf.decode([stop])) if include else c.token_text[-1] == ""
