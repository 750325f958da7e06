"""Nodes started apart (`pdserve decode` / `pdserve prefill`, as Kubernetes pools run them) with
different `--rope-theta` refuse to pair: the transfer handshake is FAILED_PRECONDITION naming
rope_theta and both values, the router passes over that prefill node (one WARNING with the
reason) and the decode node computes the prompt itself, so the tokens are transformers' for the
decode node's rotary setting. Before, rope_theta was not in the transfer digest: the pair shook
hands and the decode node continued keys rotated with one theta with another. A prefill node
started with the decode node's value pairs, takes the prompt, and the tokens are again
transformers' for the checkpoint with that theta written into its config.json."""

from __future__ import annotations

import grpc
import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Proc, creds, flags, nodes, wait_for

THETA_D, THETA_P = 500.0, 50000.0  # the checkpoint's own is 10000
NEW = 8


@pytest.fixture(scope="module")
def ckpt_theta_d(ckpt, tmp_path_factory):
    return hc.with_rope(ckpt, tmp_path_factory.mktemp("theta") / "ckpt", {"rope_theta": THETA_D})


def _node(kind: str, ckpt: str, router: str, node_id: str, theta: float) -> Proc:
    opts = flags(dtype="float32", router=router, node_id=node_id, rope_theta=theta)
    return Proc(kind, "--model", ckpt, *opts, ready=rf"{kind} node \S+ listening on (\S+)", wait=False)


def test_nodes_with_different_rope_theta_refuse_to_pair(ckpt, ckpt_theta_d):
    from client import Client
    from proto import pb, rpc
    from serving.rpc import channel

    prompt = hc.prompts(lens=(40,), seed=9)[0]
    want = hc.hf_greedy(ckpt_theta_d, prompt, NEW)
    router = Proc("router", *flags(port=0, model=ckpt), ready=r"router listening on (\S+)")
    started = [router]
    try:
        d = _node("decode", ckpt, router.address, "decode-0", THETA_D)
        p1 = _node("prefill", ckpt, router.address, "prefill-1", THETA_P)
        started += [d, p1]
        d.wait_ready()
        p1.wait_ready()
        # the handshake the router brokers, made by hand: the decode node's blobs to the prefill node
        with channel(d.address, creds()) as ch:
            blobs = rpc.DecodeNodeStub(ch).Handshake(pb.HandshakeRequest(node_id="router"), timeout=30).schema
        with channel(p1.address, creds()) as ch, pytest.raises(grpc.RpcError) as ei:
            rpc.PrefillNodeStub(ch).Handshake(pb.HandshakeRequest(node_id="decode-0", schema=blobs), timeout=30)
        e = ei.value
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, (e.code(), e.details())
        assert "rope_theta differs" in e.details() and "50000.0" in e.details() and "500.0" in e.details(), e.details()

        wait_for(lambda: len(nodes(router.address)) == 2, 60, "both nodes registered")
        with Client(router.address, timeout=120) as c:
            c.wait_ready(timeout=60)
            alone = c.generate(prompt_token_ids=prompt, max_tokens=NEW, temperature=0.0, ignore_eos=True)
            assert alone.prefill_node == "" and alone.token_ids == want, (alone.prefill_node, alone.token_ids, want)
            router.find(r"(prefill-1).*rope_theta differs", 30)  # the router's WARNING names the setting

            p2 = _node("prefill", ckpt, router.address, "prefill-2", THETA_D)
            started.append(p2)
            p2.wait_ready()
            wait_for(lambda: len(nodes(router.address)) == 3, 60, "the second prefill node registered")

            def pushed():  # a prefill node is taken once the router has seen it ready
                r = c.generate(prompt_token_ids=prompt, max_tokens=NEW, temperature=0.0, ignore_eos=True)
                return r if r.prefill_node else None

            paired = wait_for(pushed, 60, "a request prefilled on prefill-2")
        assert paired.prefill_node == "prefill-2" and paired.token_ids == want, (paired.prefill_node, paired.token_ids)
        assert "Traceback" not in p1.output() + d.output()
    finally:
        for x in reversed(started):
            x.stop()
