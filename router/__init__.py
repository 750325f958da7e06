"""The router and the `pdserve` CLI.

- server.py: the gRPC router (client `Generation`, node `Registry`), admission and streaming.
- registry.py: nodes, heartbeats, liveness, the router's in-flight discount.
- policy.py: routing policies by name (least-loaded, round-robin).
- detok.py: incremental text deltas.
- launch.py: `pdserve up`, local process pools with no orphans.
- cli.py: the `pdserve` command line.
"""
