"""Old path of ``RemoteInfEngine`` (AReaL's import path), kept as a re-export.

The client now lives in ``areal.inference.remote.engine`` (assembled from
``remote_http``, ``server_rotation``, ``server_launch`` and ``remote_weights`` beside it);
the types it shares with the backend adapters are in ``areal.api.inference_protocol``.
"""

from areal.api.inference_protocol import (
    BackendAdapter,
    GenChunk,
    GenParams,
    HttpCall,
    HttpError,
    NoHealthyServerError,
    ServerLeftRotationError,
)
from areal.inference.remote.engine import ENV_SERVER_ADDRS, RemoteInfEngine

__all__ = [
    "ENV_SERVER_ADDRS",
    "BackendAdapter",
    "GenChunk",
    "GenParams",
    "HttpCall",
    "HttpError",
    "NoHealthyServerError",
    "RemoteInfEngine",
    "ServerLeftRotationError",
]
