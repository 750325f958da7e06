"""The operator's side of the CLI: a bad value is one line and exit status 2 at parse time (ports
outside 0-65535, an unknown log level, a model path that does not exist), an error names its
command once, `generate`'s error starts a line of its own after partial output, every flag says
what it does, and a busy HTTP or metrics port is the one line (the gRPC server already started is
stopped, not left to the collector)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from router.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _one_line(capsys, words: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    return err[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--model", "m", "--port", "70000"],
        ["up", "--model", "m", "--http-port", "65536"],
        ["up", "--model", "m", "--metrics-port", "-1"],
        ["router", "--port", "70000"],
        ["router", "--http-port", "70000"],
        ["router", "--metrics-port", "70000"],
        ["decode", "--port", "70000"],
        ["prefill", "--metrics-port", "99999"],
        ["encode", "--port", "-5"],
    ],
)
def test_ports_outside_0_65535_are_refused_at_parse_time(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    line = _one_line(capsys, "is not a port (0-65535)")
    assert line.startswith(f"pdserve {argv[0]}: error: argument --")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        # were Python's "invalid literal for int() with base 10: 'a'", after the wait for the router
        (["generate", "--token-ids", "a,b", "x"], "argument --token-ids: 'a,b' is not a list of token ids"),
        (["generate", "--token-ids", "1,-2"], "argument --token-ids: '1,-2' is not a list of token ids"),
        # were taken: "no router ready after -5 s", a DEADLINE_EXCEEDED from `nodes`
        (["generate", "--wait", "-5", "hi"], "argument --wait: '-5' is not a number of seconds >= 0"),
        (["nodes", "--wait", "nan"], "argument --wait: 'nan' is not a finite number"),
    ],
)
def test_client_commands_refuse_a_bad_value_at_parse_time(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert _one_line(capsys, words).startswith(f"pdserve {argv[0]}: error: ")


def test_a_pools_file_port_is_checked_too():
    from engine.options import coerce, options
    from router.config import RouterConfig
    from router.pools import OWN

    (metrics,) = [o for o in options(RouterConfig) if o.name == "metrics_port"]
    with pytest.raises(ValueError, match="metrics_port: 70000 is not a port"):
        coerce(metrics, 70000)
    assert coerce(metrics, 9090) == 9090
    with pytest.raises(ValueError, match="is not a port"):
        OWN["port"][0](65536)


def test_unknown_log_level_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--log-level", "foo", "nodes"])
    assert e.value.code == 2
    _one_line(capsys, "unknown log level 'foo'")
    assert build_parser().parse_args(["--log-level", "debug", "nodes"]).log_level == "DEBUG"


def test_a_bad_pdserve_log_names_the_variable(monkeypatch, capsys):
    # set in a ConfigMap, not on the command line: the error named --log-level, which nobody gave
    monkeypatch.setenv("PDSERVE_LOG", "verbose")
    assert main(["nodes", "--addr", "127.0.0.1:1"]) == 2
    line = _one_line(capsys, "unknown log level 'verbose'")
    assert line.startswith("pdserve: error: PDSERVE_LOG: "), line
    monkeypatch.setenv("PDSERVE_LOG", "debug")
    with pytest.raises(SystemExit) as e:  # the flag still wins, and is checked as before
        main(["--log-level", "loud", "nodes"])
    assert e.value.code == 2 and "argument --log-level" in capsys.readouterr().err


def test_an_error_names_its_command_once(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PDSERVE_CLUSTER_TOKEN", raising=False)
    assert main(["decode", "--model", str(tmp_path)]) == 2
    line = _one_line(capsys, "no cluster token")
    assert line.startswith("pdserve decode: error: no cluster token"), line


def test_a_model_path_that_does_not_exist_is_refused_at_start(tmp_path, capsys):
    assert main(["router", "--insecure-open-cluster", "--model", str(tmp_path / "nope")]) == 2
    _one_line(capsys, "no such checkpoint directory")


def test_a_model_without_a_tokenizer_warns_once_at_start(tmp_path, caplog):
    from router.server import Router, RouterConfig

    with caplog.at_level("WARNING", logger="pdserve"):
        Router(RouterConfig(model=str(tmp_path), insecure_open_cluster=True))
    warned = [r.getMessage() for r in caplog.records if "tokenizer.json" in r.getMessage()]
    assert len(warned) == 1 and "text prompts and chat need one" in warned[0], warned


def test_generate_error_after_partial_output_starts_a_new_line(monkeypatch, capsys):
    import grpc

    import client
    from client import PdserveError

    class Chunk:
        def __init__(self, text):
            self.text, self.token_ids, self.request_id, self.logprobs, self.prompt_logprobs = text, [1], "r", [], []
            self.prompt_tokens, self.finish_reason = 0, ""
            self.timings = argparse.Namespace(ttft_s=0.0, queue_s=0.0)

    class Stream:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def __iter__(self):
            yield Chunk("Hell")
            raise PdserveError(grpc.StatusCode.UNAVAILABLE, "the decode node went away")

    class FakeClient:
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def wait_ready(self, timeout):
            pass

        def stream(self, **kw):
            return Stream()

    monkeypatch.setattr(client, "Client", FakeClient)
    assert main(["generate", "Hello"]) == 2
    out = capsys.readouterr()
    assert out.out == "Hell\n", out
    assert out.err.strip() == "pdserve generate: error: UNAVAILABLE: the decode node went away"


def _actions(cmd: str) -> list[argparse.Action]:
    ap = build_parser()
    (sub,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    return [a for a in sub.choices[cmd]._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("cmd", ["generate", "nodes", "demo", "router", "make-tiny-model", "up", "decode"])
def test_every_flag_says_what_it_does(cmd):
    bare = [a.option_strings or a.dest for a in _actions(cmd) if not a.help]
    assert not bare, f"pdserve {cmd}: flags without help: {bare}"


def test_defaults_are_shown():
    shown = {a.dest: a.help for a in _actions("generate")}
    for dest in ("addr", "max_tokens", "top_k"):
        assert "default" in shown[dest], (dest, shown[dest])
    assert "default 50051" in {a.dest: a.help for a in _actions("router")}["port"]
    assert "default 1" in {a.dest: a.help for a in _actions("demo")}["tp"]


def test_generate_says_it_waits_for_a_router_that_is_not_up(capsys):
    """No router at the address: after 2 s a line says it waits (up to --wait), then one error line."""
    import socket
    import time

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    assert main(["generate", "--addr", f"127.0.0.1:{port}", "--wait", "3", "Hello"]) == 2
    took = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "waiting up to 3 s in all (--wait)" in err[0], err
    assert err[1].startswith("pdserve generate: error: no router ready") and 2.5 < took < 10, (err, took)


def test_make_tiny_model_does_not_write_over_a_checkpoint(tmp_path, capsys):
    """A directory holding something other than a tiny model (a real checkpoint, say) is refused,
    untouched; an empty one is written."""
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3_5MoeForCausalLM"]}')
    assert main(["make-tiny-model", str(tmp_path)]) == 2
    assert "holds no tiny model" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    assert (tmp_path / "config.json").read_text().startswith('{"architectures": ["Qwen3_5Moe')


@pytest.mark.parametrize("layers", ["0", "-1"])
def test_make_tiny_model_refuses_a_model_without_layers(tmp_path, layers, capsys):
    """Was: a checkpoint of 0 layers written, that no node serves."""
    out = tmp_path / "ck"
    assert main(["make-tiny-model", str(out), "--layers", layers]) == 2
    line = _one_line(capsys, "")
    assert line == f"pdserve make-tiny-model: error: --layers must be at least 1 (got {layers})", line
    assert not out.exists()


@pytest.mark.parametrize("cmd", ["router", "decode"])
def test_a_host_that_does_not_resolve_is_one_line(cmd):
    """No gRPC `add_port.cc` log line before pdserve's own error."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_LOG="ERROR")
    argv = [sys.executable, "-m", "router.cli", cmd, "--insecure-open-cluster", "--host", "nonexistent.invalid"]
    r = subprocess.run([*argv, "--port", "0"], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"pdserve {cmd}: error: cannot bind nonexistent.invalid:0: 'nonexistent.invalid' does not")


@pytest.mark.parametrize(
    "cmd,flag,what",
    [
        ("router", "--http-port", "HTTP"),
        ("router", "--metrics-port", "metrics"),
        ("router", "--port", ""),
        ("decode", "--port", ""),
    ],
)
def test_a_busy_port_is_one_line(cmd, flag, what):
    """One line naming the port and the flag to change: no gRPC log line about it, no event-loop
    noise, and a node says it before loading its model."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_LOG="ERROR")
        ports = ["--port", "0", flag, str(port)] if flag != "--port" else ["--port", str(port)]
        argv = [sys.executable, "-m", "router.cli", cmd, "--insecure-open-cluster", *ports]
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert r.returncode == 2
    busy_words = "Address already in use" if what else "address already in use"
    assert r.stderr.strip().splitlines() == [
        f"pdserve {cmd}: error: cannot bind {what + ' ' if what else ''}127.0.0.1:{port}: {busy_words} (choose another {flag})"
    ]
