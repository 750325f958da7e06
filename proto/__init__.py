"""The wire API: pdserve.proto and its generated stubs (regenerate with `make proto`)."""

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as rpc

__all__ = ["pb", "rpc"]
