"""The router and the `pdserve` CLI: one asyncio process.

- server.py: the process's lifecycle (gRPC, HTTP and the node calls on one event loop; drain).
- service.py: the one in-process `generate` both front ends call; request.py: its phases.
- grpc_api.py: the `Generation` and `Registry` servicers (grpc.aio).
- openai_api.py, openai_models.py, openai_choices.py: the OpenAI-compatible HTTP API (FastAPI).
- net.py: every server socket and channel the router makes.
- admission.py, prefill.py, stops.py, detok.py: admission queue, prefill phase, text stops, deltas.
- registry.py: nodes, heartbeats, liveness, the router's in-flight discount.
- policy.py: routing policies by name (cache-aware, least-loaded, round-robin).
- prefix.py: what each node's prefix cache holds as the router sees it (cache-aware routing).
- launch.py, pools.py: `pdserve up`, local process pools with no orphans, its options.
- cli.py: the `pdserve` command line.
"""
