"""RPC workers: an HTTP server hosting engine objects (``rpc_server``) and its client."""

from areal.infra.rpc.client import RPCClient
from areal.infra.rpc.serialization import deserialize, serialize

__all__ = ["RPCClient", "deserialize", "serialize"]
