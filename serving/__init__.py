"""What the router and both node kinds share around the wire: the node lifecycle and drain
(node.py), gRPC servers, channels and heartbeats (rpc.py), credentials (security.py), metrics
(metrics.py), their configuration (config.py) and the engine loop thread the nodes serve from
(loop.py, its typed commands in commands.py). Nothing here is imported by the engine."""
