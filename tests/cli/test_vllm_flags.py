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
        (["up", "-tp", "2", "--decode-tp", "1"], "-tp and --decode-tp set the same option"),
        (["decode", "--tp=2", "--tensor-parallel-size=4"], "--tensor-parallel-size and --tp set the same"),
        (["up", '--speculative-config={"method": "mtp"}', "--num-speculative-tokens", "3"], "give one of them"),
        (["up", "--enable-prefix-caching", "--no-prefix-caching"], "--enable-prefix-caching and --no-prefix"),
        (["up", "--enforce-eager", "--cuda-graphs"], "--enforce-eager and --cuda-graphs"),
        (["up", "--hf-overrides", "{rope"], "--hf-overrides is not JSON"),
        (["decode", "--hf-overrides=[1, 2]"], "--hf-overrides must be a JSON object"),
        (["up", "--rope-scaling", '"yarn"'], "--rope-scaling must be a JSON object"),
        (["up", "--rope-theta", "ten"], "--rope-theta 'ten' is not a number"),
        (["prefill", "--rope-theta=-1"], "--rope-theta '-1' must be a positive number"),
        (["up", "--hf-overrides"], "--hf-overrides needs a value"),
        (["up", "--load-format", "gguf"], "--load-format gguf: pdserve takes auto or safetensors only"),
        (["up", "--quantization=awq"], "--quantization awq: pdserve takes fp8 only"),
        (["up", "--data-parallel-size", "2"], "--decode N"),
        (["up", "--limit-mm-per-prompt", '{"audio": 1}'], "unknown modality 'audio'"),
        (["up", "--limit-mm-per-prompt", "{image"], "--limit-mm-per-prompt is not JSON"),
        (["up", "--limit-mm-per-prompt", '{"image": 1}', "--max-images-per-request", "2"], "give one of them"),
        (["up", "--language-model-only", "--limit-mm-per-prompt", '{"image": 1}'], "give one of them"),
        (["serve", "m", "--port", "1", "--http-port", "2"], "--port is the HTTP port there"),
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


def test_global_options_values_are_not_the_subcommand():
    """`pdserve --log-level DEBUG up -tp 2`: up's meaning of -tp, not a node's (`--tp`)."""
    a = _parse("--log-level", "DEBUG", "up", "--model", "m", "--tensor-parallel-size", "2")
    assert (a.cmd, a.log_level, a.prefill_tp, a.decode_tp) == ("up", "DEBUG", 2, 2)


def test_global_valued_options_are_the_parsers():
    """vllm_flags.GLOBAL_VALUED lists every option before the subcommand that takes a value."""
    import argparse

    from router.vllm_flags import GLOBAL_VALUED

    valued = {
        s
        for a in build_parser()._actions
        if a.option_strings and a.nargs != 0 and not isinstance(a, argparse._SubParsersAction)
        for s in a.option_strings
    }
    assert valued == set(GLOBAL_VALUED)


def test_recipe_spellings_of_names_dtypes_and_eager_mode():
    a = _parse("up", "--model", "m", "--served-model-name", "a", "b", "--dtype", "half", "--enforce-eager")
    assert (a.served_model_name, a.dtype, a.cuda_graphs) == (["a", "b"], "float16", False)
    r = _parse("router", "--served-model-name", "a", "--served-model-name", "b")  # pdserve's own form stays
    assert r.served_model_name == ["a", "b"]
    for vllm, ours in (("bf16", "bfloat16"), ("float", "float32"), ("half", "float16"), ("bfloat16", "bfloat16")):
        assert _parse("decode", f"--dtype={vllm}").dtype == ours
    assert _parse("up", "--kv-cache-dtype", "auto", "--dtype", "bf16").dtype == "bfloat16"


def test_flags_with_no_effect_here_are_dropped_with_one_note():
    notes: list[str] = []
    argv = ["up", "--trust-remote-code", "--disable-log-requests", "--enable-chunked-prefill", "--model", "m"]
    assert rewrite(argv, notes) == ["up", "--model", "m"]
    assert len(notes) == 1 and all(f in notes[0] for f in argv[1:4]) and "no effect" in notes[0]
    assert build_parser().parse_args(rewrite(argv)).model == "m"


def test_a_qwen35_card_command_line_parses_with_its_notes():
    """The flags of Qwen3.5's vLLM recipes (multimodal, expert-parallel and scheduling switches):
    dropped with one note naming each, or read as pdserve's option."""
    notes: list[str] = []
    argv = ["up", "--model", "m", "--enable-expert-parallel", "--mm-encoder-tp-mode", "data", "--async-scheduling"]
    argv += ["--mm-processor-cache-type=shm", "--limit-mm-per-prompt", '{"image": 3, "video": 0}']
    out = rewrite(argv, notes)
    assert out == ["up", "--model", "m", "--max-images-per-request", "3"]
    assert len(notes) == 1 and all(f in notes[0] for f in ("--enable-expert-parallel", "--mm-encoder-tp-mode"))
    tls = _parse("serve", "m", "--ssl-certfile", "c.pem", "--ssl-keyfile=k.pem", "--kv-transfer-config", "{}")
    assert (tls.tls_cert, tls.tls_key) == ("c.pem", "k.pem")
    text_only = build_parser().parse_args(rewrite(["up", "--model", "m", "--language-model-only"]))
    assert text_only.max_images_per_request == 0  # images refused, as vLLM's
    a = build_parser().parse_args(out + ["--generation-config", "vllm", "--default-chat-template-kwargs", "{}"])
    assert (a.max_images_per_request, a.generation_config) == (3, "vllm")


def test_serve_takes_the_model_first_as_vllm_serve(capsys):
    a = _parse("serve", "Qwen/Qwen3.5-35B-A3B-FP8", "--tensor-parallel-size", "2", "--max-model-len", "8192")
    assert (a.model_tag, a.prefill_tp, a.decode_tp, a.max_model_len) == ("Qwen/Qwen3.5-35B-A3B-FP8", 2, 2, 8192)
    assert _parse("up", "--decode", "2", "m").model_tag == "m"
    assert (a.http_port, a.port) == (8000, None)  # vLLM's HTTP port when none is given; gRPC: up's default
    b = _parse("serve", "m", "--port", "9000", "--grpc-port=7000")
    assert (b.http_port, b.port) == (9000, 7000)  # serve's --port is vLLM's: the HTTP port
    assert _parse("up", "m", "--port", "9000").http_port is None  # up's is the router's gRPC port
    assert main(["serve", "a", "--model", "b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the model is given twice" in err[0], err


def test_kv_cache_dtype_other_than_auto_is_one_line(capsys):
    assert main(["up", "--kv-cache-dtype", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "KV cache in the model's dtype" in err[0], err


def test_model_card_overrides_parse_as_one_hf_overrides():
    """Qwen3.5's card (`--hf-overrides` with the text config's rope_parameters) as it is; Qwen3-Next's
    (`--rope-scaling`, removed from vLLM) and `--rope-theta` as the overrides they stand for, merged
    in command-line order with an `--hf-overrides` beside them, on `up` and on a node."""
    import json

    card = {
        "text_config": {
            "rope_parameters": {
                "mrope_interleaved": True,
                "mrope_section": [11, 11, 10],
                "rope_type": "yarn",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
                "factor": 4.0,
                "original_max_position_embeddings": 262144,
            }
        }
    }
    a = _parse("up", "--model", "m", "--hf-overrides", json.dumps(card), "--max-model-len", "1010000")
    assert json.loads(a.hf_overrides) == card and a.max_model_len == 1010000
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}
    for cmd in ("up", "decode", "prefill"):
        n = _parse(cmd, "--rope-scaling", json.dumps(yarn), "--model", "m", "--rope-theta=1e6")
        assert json.loads(n.hf_overrides) == {"rope_scaling": yarn, "rope_theta": 1e6} and n.model == "m"
    both = _parse(
        "up", "--hf-overrides", '{"rope_scaling": {"factor": 2.0}, "x": 1}', "--rope-scaling", json.dumps(yarn)
    )
    assert json.loads(both.hf_overrides) == {"rope_scaling": yarn, "x": 1}
    assert _parse("up", "--model", "m").hf_overrides is None
