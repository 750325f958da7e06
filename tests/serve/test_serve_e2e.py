"""`pdserve up` (router + one prefill node + one decode node, every prompt through the state
transfer) through the SDK: greedy tokens equal transformers' generate, cancellation frees both
nodes' pages and slots, bad requests are INVALID_ARGUMENT with a message and the servers go on
serving."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.helpers.serve_harness import NEW, ROOT, creds, decode_stats, nodes, prefill_stats, wait_for


def _node(cluster, node_id):
    ns = [n for n in nodes(cluster.address) if n.node.node_id == node_id]
    assert ns and ns[0].alive
    return ns[0].node


def _decode_node(cluster):
    return _node(cluster, "decode-0")


def _all_free(c) -> bool:
    return c.free_slots == c.total_slots and c.free_blocks == c.total_blocks and c.running == 0 and c.reserved == 0


def test_registry_lists_both_pools(cluster):
    from proto import pb

    got = {n.node.node_id: n for n in nodes(cluster.address)}
    assert set(got) == {"decode-0", "prefill-0"}
    assert got["decode-0"].alive and got["decode-0"].node.kind == pb.NODE_KIND_DECODE
    assert got["prefill-0"].node.kind == pb.NODE_KIND_PREFILL and got["prefill-0"].node.prefill_ready
    assert got["prefill-0"].node.schema_digest == got["decode-0"].node.schema_digest != ""
    cap = got["decode-0"].node.capacity
    assert cap.total_slots > 0 and cap.total_blocks > 0 and cap.block_size > 0


def test_greedy_matches_transformers_16_concurrent(client, refs):
    ps, want = refs
    jobs = [i % len(ps) for i in range(16)]

    def one(i):
        return client.generate(prompt_token_ids=ps[i], max_tokens=NEW, temperature=0.0, ignore_eos=True)

    with ThreadPoolExecutor(16) as ex:
        outs = list(ex.map(one, jobs))
    for i, r in zip(jobs, outs, strict=True):
        assert r.token_ids == want[i], f"prompt of {len(ps[i])} tokens"
        assert r.finish_reason == "length" and r.prompt_tokens == len(ps[i])
        assert r.decode_node == "decode-0" and r.prefill_node == "prefill-0"
        assert 0 < r.ttft_s <= r.e2e_s and r.tpot_s > 0
        assert r.transfer_bytes > 0 and r.transfer_s > 0


def test_async_client_matches(cluster, refs):
    from client import AsyncClient

    ps, want = refs

    async def main():
        async with AsyncClient(cluster.address, timeout=120) as c:
            await c.wait_ready(timeout=30)
            rs = await asyncio.gather(
                *[c.generate(prompt_token_ids=p, max_tokens=NEW, temperature=0.0, ignore_eos=True) for p in ps[:3]]
            )
            chunks = []
            async with c.stream(prompt_token_ids=ps[1], max_tokens=NEW, temperature=0.0, ignore_eos=True) as s:
                async for ch in s:
                    chunks.append(ch)
            return rs, chunks

    rs, chunks = asyncio.run(main())
    assert [r.token_ids for r in rs] == want[:3]
    assert sum((c.token_ids for c in chunks), []) == want[1] and chunks[-1].finish_reason == "length"


def test_text_prompt_streams_text(client, ckpt):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(ckpt)
    chunks = list(client.stream(prompt="hello world", max_tokens=12, temperature=0.0, ignore_eos=True))
    ids = sum((c.token_ids for c in chunks), [])
    assert len(ids) == 12 and chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in chunks) == tok.decode(ids)
    r = client.generate(prompt_token_ids=tok.encode("hello world"), max_tokens=12, temperature=0.0, ignore_eos=True)
    assert r.token_ids == ids


def test_cancelled_stream_frees_pages_and_slots(client, cluster):
    node = _decode_node(cluster)
    pnode = _node(cluster, "prefill-0")
    initial = decode_stats(node.address).capacity
    assert _all_free(initial) and _all_free(prefill_stats(pnode.address).capacity)
    s = client.stream(prompt_token_ids=list(range(1, 100)), max_tokens=4000, ignore_eos=True, temperature=0.0)
    it = iter(s)
    got = [next(it) for _ in range(3)]
    assert all(c.finish_reason is None for c in got)
    mid = decode_stats(node.address).capacity
    assert mid.free_slots == initial.free_slots - 1 and mid.free_blocks < initial.free_blocks and mid.running == 1
    s.close()

    def back():
        c = decode_stats(node.address).capacity
        return c.free_slots == initial.free_slots and c.free_blocks == initial.free_blocks and c.running == 0

    wait_for(back, 20, "free pages and slots back to their initial counts")
    wait_for(lambda: _all_free(prefill_stats(pnode.address).capacity), 20, "the prefill node's memory back")
    # the router's view (heartbeats) agrees
    wait_for(lambda: _decode_node(cluster).capacity.free_slots == initial.free_slots, 10, "heartbeat")
    # the decode node logs the cancelled request's line too, with the tokens it sent
    line = (
        r"pdserve\.decode: request (\S+): prompt 99 \(cached \d+\), output \d+ \(1 from the prefill node\), cancelled;"
    )
    rid = cluster.find(line)
    sent = int(cluster.find(rf"pdserve\.decode: request {rid}: prompt 99 \(cached \d+\), output (\d+) .*, cancelled;"))
    assert sent >= 3
    # and the router's line the bytes the prefill node pushed for it (known before the cancel)
    pushed = cluster.find(rf"pdserve\.prefill: request {rid}: .* transfer (\d+) B")
    assert int(pushed) > 0 and cluster.find(rf"pdserve\.router: request {rid}: .*cancelled; transfer (\d+) B") == pushed


def test_router_and_decode_lines_count_the_same_output(client, cluster):
    """The router's line and the decode node's count the request's output tokens, the ones the
    client got: the decode node's said one fewer (it left out the prefill node's first token)."""
    r = client.generate(prompt_token_ids=list(range(1, 40)), max_tokens=7, temperature=0.0, ignore_eos=True)
    assert len(r.token_ids) == 7 and r.prefill_node == "prefill-0"
    rid = r.request_id
    router = cluster.find(rf"pdserve\.router: request {rid}: prompt 39, .* (\d+) tokens, length")
    decode = cluster.find(
        rf"pdserve\.decode: request {rid}: prompt 39 \(cached \d+\), output (\d+ \(1 from the prefill node\)), length"
    )
    assert (int(router), decode) == (7, "7 (1 from the prefill node)")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(prompt_token_ids=[]), "empty prompt"),
        (dict(prompt=""), "empty prompt"),
        (dict(prompt_token_ids=[1] * 4096), "max_model_len"),
        (dict(prompt_token_ids=[1, 5000]), "out of range"),
        (dict(prompt_token_ids=[1, 2], max_tokens=0), "max_tokens"),
        (dict(prompt_token_ids=[1, 2], temperature=-1.0), "temperature"),
        (dict(prompt_token_ids=[1, 2], top_p=0.0), "top_p"),
        (dict(prompt_token_ids=[1, 2], top_k=-7), "top_k"),
        (dict(prompt_token_ids=[1, 2], seed=-1), "seed"),
    ],
    ids=["empty-ids", "empty-text", "oversized", "vocab", "max_tokens", "temperature", "top_p", "top_k", "seed"],
)
def test_bad_requests_are_invalid_argument(client, kwargs, needle):
    from client import PdserveError

    with pytest.raises(PdserveError) as ei:
        client.generate(**kwargs)
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in ei.value.message
    r = client.generate(prompt_token_ids=[1, 2, 3], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(r.token_ids) == 4  # still serving


def test_decode_node_refuses_bad_input_itself(cluster):
    """The node validates too (a router is not its only caller)."""
    from proto import pb, rpc
    from serving.rpc import channel

    node = _decode_node(cluster)
    with channel(node.address, creds()) as ch:
        stub = rpc.DecodeNodeStub(ch)
        for req, needle in [
            (pb.DecodeRequest(prompt_token_ids=[], sampling=pb.SamplingParams()), "empty prompt"),
            (pb.DecodeRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(top_p=2.0)), "top_p"),
            (pb.DecodeRequest(prompt_token_ids=[1] * 5000, sampling=pb.SamplingParams()), "max_model_len"),
        ]:
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.Generate(req, timeout=30))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in ei.value.details()
        out = list(
            stub.Generate(
                pb.DecodeRequest(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=3)), timeout=30
            )
        )
        assert sum(len(m.token_ids) for m in out) == 3 and out[-1].finish_reason == "length"


def test_health_and_reflection(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from serving.rpc import channel

    for addr, service in [
        (cluster.address, "pdserve.v1.Generation"),
        (_decode_node(cluster).address, "pdserve.v1.DecodeNode"),
    ]:
        with channel(addr, creds()) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            resp = next(
                reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
                )
            )
            assert service in {s.name for s in resp.list_services_response.service}


def test_list_models(client, ckpt):
    ms = client.list_models()
    assert [m.path for m in ms] == [ckpt] and ms[0].has_tokenizer and ms[0].vocab_size == 1024


def test_cli_generate_streams_text(cluster):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    gen = [sys.executable, "-m", "router.cli", "generate", "--addr", cluster.address]
    run = dict(capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    r = subprocess.run([*gen, "hello", "--max-tokens", "5", "--temperature", "0", "--ignore-eos"], **run)
    assert r.returncode == 0, r.stderr
    assert "5 tokens, length" in r.stderr
    bad = subprocess.run([*gen, "--token-ids", "1,2", "--max-tokens", "0"], **run)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr
    assert "INVALID_ARGUMENT" in bad.stderr and "max_tokens" in bad.stderr


def test_cli_generate_chat(cluster, ckpt):
    """`pdserve generate --chat`: the router renders the chat template (prompt tokens as
    transformers counts them) and the answer on stdout is transformers' greedy continuation."""
    from transformers import AutoTokenizer

    from tests.helpers import hybrid_ckpt as hc

    hf = AutoTokenizer.from_pretrained(ckpt)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    ids = hf.encode(
        hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False),
        add_special_tokens=False,
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "router.cli", "generate", "--addr", cluster.address, "hello", "--chat"]
    cmd += ["--system", "Be brief.", "--no-thinking", "--max-tokens", "6", "--temperature", "0", "--ignore-eos"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert f"[{len(ids)} prompt tokens, 6 new, length;" in r.stderr, r.stderr
    assert r.stdout.rstrip("\n") == hf.decode(hc.hf_greedy(ckpt, ids, 6), skip_special_tokens=True).rstrip("\n")


def test_one_log_line_per_request(client, cluster):
    r = client.generate(prompt_token_ids=[7, 8, 9], max_tokens=5, temperature=0.0, ignore_eos=True, request_id="log-me")
    assert r.request_id == "log-me"

    def lines():
        return [ln for ln in cluster.lines if "request log-me:" in ln]

    def both():  # the prefill node logs too, and any of the three may come first
        got = lines()
        return any("pdserve.router" in ln for ln in got) and any("pdserve.decode" in ln for ln in got) and got

    got = wait_for(both, 10, "the router's and the node's log lines")
    router = [ln for ln in got if "pdserve.router" in ln]
    node = [ln for ln in got if "pdserve.decode" in ln]
    assert len(router) == 1 and len(node) == 1, got
    assert "prompt 3, decode decode-0, prefill prefill-0" in router[0] and "ttft" in router[0] and "tpot" in router[0]
    assert re.search(r"transfer [1-9]\d* B in \d+\.\d ms", router[0]), router[0]
    pre = wait_for(
        lambda: [ln for ln in cluster.lines if "pdserve.prefill" in ln and "request log-me:" in ln],
        10,
        "the prefill node's log line",
    )
    assert len(pre) == 1 and "pushed" in pre[0]


def test_reserve_release_and_lease_expiry(cluster):
    """The decode node's reservation seam: pages for prompt + 1 tokens and one GDN slot, held
    under a lease, returned by Release or by the lease running out."""
    from proto import pb, rpc
    from serving.rpc import channel

    node = _decode_node(cluster)
    initial = decode_stats(node.address).capacity
    with channel(node.address, creds()) as ch:
        stub = rpc.DecodeNodeStub(ch)
        sp = pb.SamplingParams(max_tokens=4)
        t = stub.Reserve(
            pb.ReserveRequest(request_id="res-1", prompt_token_ids=[1] * 40, sampling=sp), timeout=30
        ).target
        assert t.request_id == "res-1" and t.node_id == "decode-0" and t.num_tokens == 40 and t.tp_size == 1
        assert len(t.ranks) == 1 and len(t.ranks[0].block_ids) == 3  # 41 tokens in 16-token pages
        assert t.ranks[0].agent.startswith("decode-0.receiver.r0.") and t.ranks[0].incarnation
        assert t.schema_digest == node.schema_digest and t.lease_s > 0
        held = decode_stats(node.address).capacity
        assert (held.free_slots, held.free_blocks, held.reserved) == (
            initial.free_slots - 1,
            initial.free_blocks - 3,
            1,
        )
        assert stub.Release(pb.ReleaseRequest(request_id="res-1"), timeout=30).released
        assert not stub.Release(pb.ReleaseRequest(request_id="res-1"), timeout=30).released
        c = decode_stats(node.address).capacity
        assert (c.free_slots, c.free_blocks, c.reserved) == (initial.free_slots, initial.free_blocks, 0)
        stub.Reserve(
            pb.ReserveRequest(request_id="res-2", prompt_token_ids=[2] * 5, sampling=sp, lease_s=0.3), timeout=30
        )
        assert decode_stats(node.address).capacity.reserved == 1

        def expired():
            c = decode_stats(node.address).capacity
            return c.reserved == 0 and c.free_slots == initial.free_slots and c.free_blocks == initial.free_blocks

        wait_for(expired, 10, "the lease to expire")
        with pytest.raises(grpc.RpcError) as ei:
            stub.Reserve(pb.ReserveRequest(request_id="res-3", prompt_token_ids=[], sampling=sp), timeout=30)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_prefill_streams_first_token_before_the_push_report(cluster, refs):
    """The node-facing seam, driven by hand as the router drives it: Reserve on the decode node,
    broker the handshake, then PrefillNode.Prefill streams the first token (no transfer figures
    yet) and afterwards a `pushed` message with them; the decode node's Generate(reserved) then
    continues with transformers' tokens."""
    from proto import pb, rpc
    from serving.rpc import channel

    ps, want = refs
    prompt = ps[3]  # 65 tokens: five pages
    d, p = _decode_node(cluster), _node(cluster, "prefill-0")
    sp = pb.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    with channel(d.address, creds()) as dch, channel(p.address, creds()) as pch:
        dec, pre = rpc.DecodeNodeStub(dch), rpc.PrefillNodeStub(pch)
        pr = pre.Handshake(pb.HandshakeRequest(node_id="test"), timeout=60)
        dr = dec.Handshake(
            pb.HandshakeRequest(node_id=p.node_id, incarnation=p.incarnation, schema=pr.schema), timeout=60
        )
        pre.Handshake(pb.HandshakeRequest(node_id=d.node_id, incarnation=d.incarnation, schema=dr.schema), timeout=60)
        target = dec.Reserve(
            pb.ReserveRequest(request_id="two-msg", prompt_token_ids=prompt, sampling=sp), timeout=30
        ).target
        req = pb.PrefillRequest(request_id="two-msg", prompt_token_ids=prompt, sampling=sp, target=target)
        msgs = list(pre.Prefill(req, timeout=60))
        assert len(msgs) == 2, msgs
        first, pushed = msgs
        assert not first.pushed and first.finish_reason == "" and first.first_token_id == want[3][0]
        assert first.timings.ttft_s > 0 and first.timings.transfer_bytes == 0  # sent before the push report
        assert pushed.pushed and pushed.timings.transfer_bytes > 0 and pushed.timings.transfer_s > 0
        req = pb.DecodeRequest(
            request_id="two-msg",
            prompt_token_ids=prompt,
            sampling=sp,
            reserved=True,
            first_token_id=first.first_token_id,
        )
        rest = [t for m in dec.Generate(req, timeout=60) for t in m.token_ids]
        assert [first.first_token_id, *rest] == want[3]
    wait_for(lambda: _all_free(decode_stats(d.address).capacity), 20, "the decode node's memory back")


def test_async_stream_close_cancels(cluster):
    from client import AsyncClient

    node = _decode_node(cluster)
    initial = decode_stats(node.address).capacity

    async def main():
        async with AsyncClient(cluster.address, timeout=120) as c:
            s = c.stream(prompt_token_ids=[5, 6, 7], max_tokens=4000, ignore_eos=True)
            n = 0
            async for ch in s:
                n += len(ch.token_ids)
                if n >= 3:
                    break
            assert decode_stats(node.address).capacity.free_slots == initial.free_slots - 1
            await s.close()

    asyncio.run(main())

    def back():
        c = decode_stats(node.address).capacity
        return c.free_slots == initial.free_slots and c.free_blocks == initial.free_blocks and c.running == 0

    wait_for(back, 20, "free pages and slots back after the async stream closed")


def test_cancel_during_prefill_releases_both_nodes(cluster, client):
    """Cancelled while the prefill node computes (or pushes): the push is aborted, the
    reservation released, and both nodes' pages and slots come back."""
    import time

    from proto import pb, rpc
    from serving.rpc import channel

    d, p = _decode_node(cluster), _node(cluster, "prefill-0")
    with channel(cluster.address, creds()) as ch:
        stub = rpc.GenerationStub(ch)
        for delay in (0.05, 0.3):
            call = stub.Generate(
                pb.GenerateRequest(prompt_token_ids=[3] * 2000, sampling=pb.SamplingParams(max_tokens=8))
            )
            time.sleep(delay)
            call.cancel()
            with pytest.raises(grpc.RpcError) as ei:
                list(call)
            assert ei.value.code() == grpc.StatusCode.CANCELLED
    wait_for(lambda: _all_free(decode_stats(d.address).capacity), 20, "the decode node's memory back")
    wait_for(lambda: _all_free(prefill_stats(p.address).capacity), 20, "the prefill node's memory back")

    # the router's lines name where each was (the prefill node, or "-" not yet placed), never "local"
    def logged():
        got = [ln for ln in cluster.lines if "pdserve.router: request" in ln and "prompt 2000," in ln]
        return got if len(got) == 2 else None

    lines = wait_for(logged, 20, "the router's two lines")
    assert all(re.search(r"prefill (prefill-0|-),", ln) for ln in lines), lines
    # a prompt no earlier test sent (the decode node would compute the next turn of one it holds)
    r = client.generate(prompt_token_ids=[901, 902, 903], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(r.token_ids) == 4 and r.prefill_node == "prefill-0"
