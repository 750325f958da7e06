"""vLLM's spellings on pdserve's command line (router/vllm_flags.py): each becomes pdserve's option
with the same meaning, parsed by the real parser; a value pdserve cannot take is one line and exit
status 2 naming it."""

from __future__ import annotations

import pytest

from router.cli import build_parser, main
from router.vllm_flags import rewrite


def _parse(*argv: str):
    return build_parser().parse_args(rewrite(list(argv)))


def test_a_copied_vllm_recipe_parses_as_its_meaning():
    spec = '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}'
    a = _parse(
        "up", "--model", "m", "--tensor-parallel-size", "2", "--speculative-config", spec, "--enable-prefix-caching"
    )
    assert (a.prefill_tp, a.decode_tp) == (2, 2)
    assert (a.speculative_method, a.num_speculative_tokens, a.prefix_caching) == ("mtp", 2, True)
    d = _parse(
        "decode", "--model", "m", "-tp=4", '--speculative-config={"method": "ngram"}', "--no-enable-prefix-caching"
    )
    assert (d.tp, d.speculative_method, d.prefix_caching) == (4, "ngram", False)
    assert rewrite(["generate", "--addr", "a:1", "hi -tp 2"]) == ["generate", "--addr", "a:1", "hi -tp 2"]


@pytest.mark.parametrize(
    "argv,words",
    [
        (["up", "--speculative-config", "{mtp}"], "not JSON"),
        (["up", "--speculative-config", '{"method": "eagle3"}'], "method 'eagle3'"),
        (["up", "--speculative-config", '{"method": "mtp", "draft_model": "x"}'], "draft_model not supported"),
        (["up", "--speculative-config", '{"num_speculative_tokens": -1}'], "integer >= 0"),
        (["up", "--tensor-parallel-size"], "needs a value"),
    ],
)
def test_what_pdserve_cannot_take_is_one_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdserve: error: ") and words in err[0], err


def test_version_is_the_installed_distributions(capsys):
    """`pdserve --version`: the version pip installed (the distribution's metadata), exit 0."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"pdserve {version('pdserve')}"
