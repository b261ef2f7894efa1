"""Payload encoding for controller <-> worker RPC.

Payloads are ``pickle`` bytes (tensors pickle through torch's own reducers, so they
travel as raw storage bytes). Pickle executes code on load: this is only safe because
workers bind to 127.0.0.1 (or a trusted cluster network) and both ends are our own
processes. Never expose an RPC worker to an untrusted network.

Callables (e.g. ``loss_fn``) travel by reference: they must be importable module-level
functions on the worker.
"""

from __future__ import annotations

import pickle
from typing import Any

CONTENT_TYPE = "application/x-areal-pickle"


def serialize(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def deserialize(data: bytes) -> Any:
    return pickle.loads(data)  # noqa: S301 - trusted loopback peers only (see module doc)
