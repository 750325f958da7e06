"""Decode node: a gRPC server around one EngineCore (t worker ranks). See server.py."""
