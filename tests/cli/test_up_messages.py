"""What `pdserve up` says when a node exits (router/cli.py `_exit_cause`): the signal, and what
follows: the router routes around one node of several; the last of its pool says what is lost."""

from __future__ import annotations

from router.cli import _exit_cause


def test_a_node_exit_says_what_follows():
    assert _exit_cause(0) == ""
    assert _exit_cause(-9) == " (SIGKILL); the router routes around it"
    assert "a crash in native code" in _exit_cause(-11)
    assert _exit_cause(1).startswith("; the router routes around it")
    assert _exit_cause(-9, "decode") == " (SIGKILL); no decode node is left: every request fails until one registers"
    assert "no prefill node is left: decode nodes compute the prompts" in _exit_cause(1, "prefill")
    assert "no decode node is left" in _exit_cause(0, "decode")
