"""Helpers the tests share: tiny checkpoints, clusters, transfer rigs, kernel cases, a CA."""
