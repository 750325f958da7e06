"""Prefill node: a gRPC server around an EngineCore with prefill-only requests; the engine's
connector (transfer/connector/prefill.py) pushes each request's state into the decode node's
reservation named by its TransferTarget (server.py maps the RPCs to the engine loop, serving.loop)."""
