"""--drain-handoff on a decode node that is its pool's only one: handing its streams off sent them
to a router with no other decode node to place them on, so requests a plain drain would have
finished failed UNAVAILABLE once the router's admission wait ran out. The node now hands off only
when a router knows another decode node that is up, and otherwise finishes its streams itself
and says why in its log."""

from __future__ import annotations

import os
import signal

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Up, flags, node_pid, wait_for

N = 400  # still decoding well past the 0.1 s hand-off


def test_a_lone_decode_node_finishes_its_streams_instead_of_handing_them_off(ckpt):
    from client import Client, GenerateResult

    u = Up(
        "--model",
        ckpt,
        *flags(dtype="float32", prefill=0, decode=1, drain_handoff=0.1, drain_timeout=60, admission_timeout=1),
    )
    p = hc.prompts(lens=(20,), seed=3)[0]
    try:
        with Client(u.address, timeout=120) as c:
            c.wait_ready(60)
            res = GenerateResult()
            with c.stream(prompt_token_ids=p, max_tokens=N, temperature=0.0, ignore_eos=True) as s:
                it = iter(s)
                res.add(next(it))  # decoding now
                os.kill(node_pid(u, "decode-0"), signal.SIGTERM)
                for ch in it:
                    res.add(ch)
        assert len(res.token_ids) == N and res.finish_reason == "length"
        assert hc.hf_greedy_violations(ckpt, p, res.token_ids) == []
        assert u.find(r"decode node decode-0: --drain-handoff: (no other decode node is up)")
        wait_for(lambda: "decode-0 exited with status 0" in u.output(), 30, "decode-0 to exit once drained")
        assert "handing 1 stream(s) off" not in u.output()
    finally:
        u.stop()
