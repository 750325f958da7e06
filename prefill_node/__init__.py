"""Prefill node: a gRPC server around an EngineCore with prefill-only requests; every rank has a
transfer Sender, and each request's state is pushed into the decode node's reservation named by
its TransferTarget (server.py; the rank-side helpers are transfer.rank; the engine loop is serving.loop)."""
