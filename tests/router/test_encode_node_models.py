"""The models a router lists with an encode node in its cluster, in process against fake nodes: an
encode node holds only the vision tower (no vocabulary, no context length), so it must not stand
for the model. Registered before the decode node (it loads faster, so in `pdserve up --encode N`
it usually is), it made /v1/models, gRPC ListModels and /tokenize report max_model_len 0, and
turned Responses' `truncation: "auto"` off; the lists now carry the decode node's values."""

from __future__ import annotations

import http.client
import json

from proto import pb, rpc
from serving.rpc import start_server
from tests.helpers.fake_node import FakeDecode, decode_info, heartbeat
from tests.helpers.front_door import post
from tests.helpers.serve_harness import wait_for

CTX = 300


def test_an_encode_node_does_not_stand_for_the_model(ckpt):
    from client import Client
    from router.server import RouterConfig, serve

    fake = FakeDecode([5, 6, 7], delay_s=0.0)
    srv, nport, _ = start_server("127.0.0.1:0", lambda s: rpc.add_DecodeNodeServicer_to_server(fake, s), ["DecodeNode"])
    r, port = serve("127.0.0.1:0", RouterConfig(model=str(ckpt), heartbeat_interval_s=0.1, http_port=0))
    info = decode_info(f"127.0.0.1:{nport}", max_model_len=CTX, vocab_size=1024)
    enc = pb.NodeInfo(node_id="encode-0", kind=pb.NODE_KIND_ENCODE, address="127.0.0.1:9", incarnation=1)
    enc.model = info.model  # the same checkpoint, as `pdserve up` starts it
    beats = [heartbeat(f"127.0.0.1:{port}", enc, 0.1)]
    try:
        wait_for(lambda: r.registry.live(pb.NODE_KIND_ENCODE), 10, "the encode node registered")
        beats.append(heartbeat(f"127.0.0.1:{port}", info, 0.1))
        wait_for(lambda: r.registry.live(pb.NODE_KIND_DECODE), 10, "the decode node registered")
        conn = http.client.HTTPConnection("127.0.0.1", r.http_port, timeout=30)
        conn.request("GET", "/v1/models")
        (card,) = json.loads(conn.getresponse().read())["data"]
        conn.close()
        assert card["max_model_len"] == CTX, card
        with Client(f"127.0.0.1:{port}", timeout=30) as c:
            (m,) = c.list_models()
        assert (m.max_model_len, m.vocab_size) == (CTX, 1024)
        status, out = post(r.http_port, json.dumps({"prompt": "hello"}).encode(), "/tokenize")
        assert status == 200 and out["max_model_len"] == CTX, out
        # truncation "auto" keeps the last turn that fits (it needs the context length)
        long = [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"}]
        body = {"input": [*long, {"role": "user", "content": "hi"}], "truncation": "auto", "max_output_tokens": 8}
        status, out = post(r.http_port, json.dumps(body).encode(), "/v1/responses")
        assert status == 200, out
    finally:
        for b in beats:
            b.stop()
        r.stop(0)
        srv.stop(0)
