"""Start a real built-in inference server on 127.0.0.1 and connect a client to it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from areal.api.cli_args import InferenceEngineConfig


@contextlib.contextmanager
def local_engine(
    model_dir: str, setup_timeout: float = 120.0, **config: object
) -> Iterator[object]:
    """``RemoteLocalEngine`` connected to one built-in server serving ``model_dir``
    (``config``: more ``InferenceEngineConfig`` fields)."""
    from areal.inference.clients.local import RemoteLocalEngine

    eng = RemoteLocalEngine(InferenceEngineConfig(setup_timeout=setup_timeout, **config))
    eng.launch_server({"model_path": model_dir})
    try:
        eng.initialize()
        yield eng
    finally:
        eng.destroy()
        eng.teardown_server()
