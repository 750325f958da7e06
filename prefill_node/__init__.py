"""Prefill node: a gRPC server that will prefill prompts and push their state to decode nodes.
For now a stub (server.py) that registers with the router as not prefill-ready."""
