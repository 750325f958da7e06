"""A pools file's values are read as the flags would read them or refused in one line, before
anything starts: a YAML syntax error and an empty pool key are `pdserve up: error: ...` (they
were tracebacks), a fractional number for a whole one is refused (`max_num_seqs: 8.5` ran 8
sequences), a boolean is no number, NaN and infinity are no number of seconds, null is no name.
A key given twice (a second `decode:` further down, `max-model-len` beside `max_model_len`,
`prefill_tp` beside `prefill: {tp}`) is refused; the last one won unseen. The command line's
number flags refuse NaN too, and a node refuses an empty --node-id, which the
router would refuse at every Register while the node only logged it and retried."""

from __future__ import annotations

import pytest

from decode_node.config import DecodeNodeConfig
from engine.options import coerce, options
from router.cli import main


def _refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:  # argparse's refusal
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("model: [\n", "not valid YAML at line 2, column 1: expected the node content"),
        ("decode: 1\n  prefill: 2\n", "not valid YAML at line 2, column 10: mapping values are not allowed"),
        ("prefill:\n", "prefill: cannot read None as int"),
        ("prefill: 1.5\n", "prefill: cannot read 1.5 as int"),
        ("max_num_seqs: 8.5\n", "max_num_seqs: cannot read 8.5 as int"),
        ("max_num_seqs: true\n", "max_num_seqs: cannot read True as int"),
        ("decode: {count: 1, max_num_seqs: 2.9}\n", "max_num_seqs: cannot read 2.9 as int"),
        ("heartbeat_interval: .nan\n", "heartbeat_interval: cannot read nan as float"),
        ("admission_timeout: .inf\n", "admission_timeout: cannot read inf as float"),
        ("drain_timeout: -1\n", "drain_timeout: -1 is not a number of seconds >= 0"),
        ("drain_timeout: .nan\n", "drain_timeout: nan is not a finite number"),
        ("port: 5.5\n", "port: 5.5 is not a port number"),
        ("served_model_name: [a, null]\n", "served_model_name: cannot read ['a', None] as str"),
        ("policy: [round-robin]\n", "policy: cannot read ['round-robin'] as str"),
        ("dtype: {x: 1}\n", "dtype: cannot read {'x': 1} as str"),
        # a key twice: PyYAML kept the last one silently
        ("decode: 1\nprefill: 1\ndecode: {count: 2}\n", "not valid YAML at line 3, column 1: decode is given twice"),
        ("decode: {count: 1, count: 2}\n", "line 1, column 20: count is given twice"),
        (
            "max-model-len: 100\nmax_model_len: 200\n",
            "max_model_len is given twice (as max-model-len and max_model_len)",
        ),
        ("decode: {max_num_seqs: 2, max-num-seqs: 3}\n", "max_num_seqs is given twice under decode"),
        ("prefill_tp: 4\nprefill: {tp: 2}\n", "prefill_tp is given twice (as prefill_tp and prefill: {tp: ...})"),
    ],
)
def test_a_bad_file_value_is_one_line(tmp_path, capsys, text, words):
    cfg = tmp_path / "pools.yaml"
    cfg.write_text(text)
    assert main(["up", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdserve up: error: ") and words in err[0], err


def test_values_that_read_the_same_are_taken():
    by_name = {o.name: o for o in options(DecodeNodeConfig)}
    assert coerce(by_name["block_size"], 32.0) == 32 and coerce(by_name["max_num_seqs"], "8") == 8
    assert coerce(by_name["heartbeat_interval_s"], 2) == 2.0
    assert coerce(by_name["kv_cache_memory"], 1024) == "1024"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["decode", "--drain-timeout", "-1"], "argument --drain-timeout: '-1' is not a number of seconds >= 0"),
        (["router", "--drain-timeout", "nan"], "argument --drain-timeout: 'nan' is not a finite number"),
        (["up", "--drain-timeout", "inf"], "argument --drain-timeout: 'inf' is not a finite number"),
        (["router", "--heartbeat-interval", "nan"], "argument --heartbeat-interval: 'nan' is not a finite number"),
        (["prefill", "--push-timeout", "nan"], "argument --push-timeout: 'nan' is not a finite number"),
    ],
)
def test_number_flags_refuse_nan_and_negative_drains(capsys, argv, words):
    line = _refused(capsys, argv)
    assert line.startswith(f"pdserve {argv[0]}: error: ") and words in line, line


@pytest.mark.parametrize("node_id", ["", " ", " decode-0"])
def test_a_node_needs_a_name(node_id):
    with pytest.raises(ValueError, match="--node-id .*: give the node a name"):
        DecodeNodeConfig(model="m", node_id=node_id)
    assert DecodeNodeConfig(model="m", node_id="pdserve-decode-0").node_id == "pdserve-decode-0"
