"""The router's readiness and liveness as plain-HTTP answers (serving/probes.py): the OpenAI port's
`/health` and `/ping`, and `/health` and `/live` on the metrics port, which stays plain HTTP when
the router's ports speak TLS (the probes of deploy/k8s/components/tls). Readiness is what the gRPC
health service answers for pdserve.v1.Generation: a live decode node takes requests and the
router does not drain."""

from __future__ import annotations

from proto import pb
from router.errors import NO_DECODE
from serving.probes import Answer, Probes


def readiness(service) -> Answer:
    """200 while the router can serve; 503 saying why while it cannot."""
    if service.draining:
        return 503, {"status": "draining"}
    live = len(service.registry.routable(pb.NODE_KIND_DECODE))
    if not live:  # requests would wait for one, then be refused
        return 503, {"status": "no_decode_node", "decode_nodes": 0, "message": NO_DECODE}
    return 200, {"status": "ok", "decode_nodes": live}


def probes(router) -> Probes:
    """The metrics port's /health (readiness) and /live (200 until the router stops)."""

    def live() -> Answer:
        return (503, {"status": "stopping"}) if router.stopped else (200, {"status": "ok"})

    return Probes(lambda: readiness(router.service), live)
