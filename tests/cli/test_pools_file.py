"""A pools file read as an operator writes one: relative paths in it are the file's directory's (a
`model: ./ckpt` beside the file ran from another directory looked for the shell's `./ckpt`), and
vLLM's key spellings, which `up`'s command line already takes as flags, are taken as keys too
(`tensor-parallel-size: 2` was an unknown key); two spellings of one option are refused."""

from __future__ import annotations

import json

import pytest

from router.cli import build_parser, main
from router.pools import spec_from_args
from tests.helpers import hybrid_ckpt as hc


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("pools-file") / "ckpt", hc.SPEC_HV2)


def _spec(path):
    return spec_from_args(build_parser().parse_args(["up", "--config", str(path)]), default_model=lambda: None)


def test_relative_paths_are_the_files_directory(tmp_path, ckpt, monkeypatch):
    conf = tmp_path / "deploy" / "conf"
    conf.mkdir(parents=True)
    (tmp_path / "deploy" / "models").mkdir()
    (tmp_path / "deploy" / "models" / "tiny").symlink_to(ckpt)
    (conf / "token").write_text("s3cret-token\n")
    (conf / "chat.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (conf / "pools.yaml").write_text(
        "model: ../models/tiny\ncluster_token_file: token\nchat_template: chat.jinja\ndecode: {count: 1}\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # neither ../models/tiny nor token exists from here
    spec = _spec(conf / "pools.yaml")
    assert spec.model == str((tmp_path / "deploy" / "models" / "tiny").resolve())
    assert spec.cluster_token == "s3cret-token"
    assert spec.router_options["chat_template"] == str(conf / "chat.jinja")
    # a template given as its text is no path
    (conf / "inline.yaml").write_text("model: ../models/tiny\nchat_template: '{{ messages[0].content }}'\n")
    assert _spec(conf / "inline.yaml").router_options["chat_template"] == "{{ messages[0].content }}"


def test_vllm_keys_read_as_its_flags(tmp_path, ckpt):
    f = tmp_path / "pools.yaml"
    f.write_text(
        f"model: {ckpt}\n"
        "tensor-parallel-size: 2\n"
        "enforce-eager: true\n"
        "kv-cache-dtype: auto\n"
        "dtype: half\n"
        "enable-prefix-caching: false\n"
        "trust-remote-code: true\n"
        "max-model-len: 512\n"
        "speculative-config: {method: qwen3_next_mtp, num_speculative_tokens: 0}\n"
        "decode: {count: 1, max-num-seqs: 4}\n"
    )
    spec = _spec(f)
    assert (spec.prefill_tp, spec.decode_tp) == (2, 2)
    d = spec.decode_options
    assert d["cuda_graphs"] is False and d["dtype"] == "float16" and d["enable_prefix_caching"] is False
    assert d["max_model_len"] == 512 and d["max_num_seqs"] == 4
    assert (d["speculative_method"], d["num_speculative_tokens"]) == ("mtp", 0)
    f.write_text(
        f'model: {ckpt}\nprefill: {{count: 1, tensor_parallel_size: 2}}\nspeculative_config: \'{{"method": "ngram"}}\'\n'
    )
    spec = _spec(f)
    assert (spec.prefill_tp, spec.decode_tp) == (2, 1) and spec.prefill_options["speculative_method"] == "ngram"
    f.write_text(
        f"model: {ckpt}\nlimit-mm-per-prompt: {{image: 2, video: 0}}\nmm-encoder-tp-mode: data\n"
        "enable-expert-parallel: true\noverride-generation-config: {temperature: 0.5}\n"
    )
    r = _spec(f).router_options
    assert r["max_images_per_request"] == 2 and json.loads(r["override_generation_config"]) == {"temperature": 0.5}
    f.write_text(f"model: {ckpt}\nlanguage_model_only: true\n")
    assert _spec(f).router_options["max_images_per_request"] == 0


def test_hf_overrides_key_reaches_the_router_and_every_node(tmp_path, ckpt, monkeypatch):
    """vLLM's `hf_overrides` as a mapping (or its JSON text): the router and both pools get it, and
    `up`'s checks read the config with it (a max_model_len past the checkpoint's context is taken);
    pools given different rotary settings are refused before anything starts."""
    import json

    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    f = tmp_path / "pools.yaml"
    f.write_text(
        f"model: {ckpt}\nmax-model-len: 16384\n"
        "hf_overrides:\n  rope_parameters: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 4096}\n"
    )
    spec = _spec(f)
    for opts in (spec.router_options, spec.decode_options, spec.prefill_options):
        assert json.loads(opts["hf_overrides"]) == {"rope_parameters": yarn}
    f.write_text(f"model: {ckpt}\nmax-model-len: 16384\nhf-overrides: '{json.dumps({'rope_parameters': yarn})}'\n")
    assert json.loads(_spec(f).decode_options["hf_overrides"]) == {"rope_parameters": yarn}
    f.write_text(f"model: {ckpt}\nmax-model-len: 16384\n")
    with pytest.raises(ValueError, match="max_model_len 16384 exceeds the checkpoint's 4096 positions"):
        _spec(f)
    # one pool's own: its nodes would rotate keys as the other pool's do not
    f.write_text(f"model: {ckpt}\ndecode: {{count: 1, hf_overrides: {{rope_theta: 5000.0}}}}\n")
    with pytest.raises(ValueError, match=r"pools differ in rope_theta \(hf_overrides\) \(10000.0 vs 5000.0\)"):
        _spec(f)


def test_a_pools_file_that_cannot_be_read_is_named(tmp_path, capsys):
    assert main(["up", "--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"pdserve up: error: --config {tmp_path / 'nope.yaml'}: cannot read the pools file (No such file or directory)"
    ]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (
            "tensor-parallel-size: 2\nprefill_tp: 1\n",
            "prefill_tp is given twice (as tensor-parallel-size and prefill_tp)",
        ),
        (
            "tensor_parallel_size: 2\ndecode: {tp: 1}\n",
            "decode_tp is given twice (as tensor_parallel_size and decode: {tp: ...})",
        ),
        (
            "decode: {tp: 1, tensor-parallel-size: 2}\n",
            "tp is given twice under decode (as tp and tensor-parallel-size)",
        ),
        ("enforce_eager: true\ncuda_graphs: true\n", "cuda_graphs is given twice (as enforce_eager and cuda_graphs)"),
        ("enable-prefix-caching: true\nprefix_caching: true\n", "prefix_caching is given twice"),
        ("kv_cache_dtype: fp8\n", "kv_cache_dtype fp8: pdserve keeps the KV cache in the model's dtype"),
        ("speculative_config: {method: eagle3}\n", "speculative_config method 'eagle3'"),
        ("encode: {count: 1, tensor_parallel_size: 2}\n", "unknown key(s) under encode: tp"),
        ("hf_overrides: [rope_theta]\n", "hf_overrides must be a JSON object"),
        ("hf-overrides: '{rope'\n", "hf_overrides is not JSON"),
        ("load_format: gguf\n", "load_format gguf: pdserve takes auto or safetensors only"),
    ],
)
def test_two_spellings_or_a_value_pdserve_cannot_take_are_refused(tmp_path, capsys, text, words):
    f = tmp_path / "pools.yaml"
    f.write_text(text)
    assert main(["up", "--config", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
