"""The inference protocol: the types the remote client and the backend adapters share.

``areal.inference.remote.engine.RemoteInfEngine`` (the client) speaks to a server
only through a ``BackendAdapter`` (``areal.inference.clients.{local,vllm,sglang}``); both sides
use the types defined here and nothing of each other:

- ``GenParams``: the sampling parameters of one chunk of a request;
- ``HttpCall``: one HTTP request an adapter builds (path, JSON payload, method);
- ``GenChunk``: one generate answer parsed by the adapter (tokens, logprobs, versions,
  stop reason);
- :func:`stop_reason`: a server's finish reason -> ``"stop"`` | ``"length"`` | ``"abort"``;
- ``BackendAdapter``: the calls of one server protocol (generate, images, pause/resume,
  weight reloads, versions);
- the errors: ``HttpError`` (a server answered >= 400), ``NoHealthyServerError`` (no
  server left in rotation), ``ServerLeftRotationError`` (the server of an in-flight
  request left the rotation; the request moves).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from areal.api.io_struct import ParamSpec, WeightUpdateMeta

__all__ = [
    "BackendAdapter",
    "GenChunk",
    "GenParams",
    "HttpCall",
    "HttpError",
    "NoHealthyServerError",
    "ServerLeftRotationError",
    "stop_reason",
]


@dataclasses.dataclass
class GenParams:
    """Sampling parameters of one chunk of a request."""

    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    greedy: bool
    stop_token_ids: list[int]
    ignore_eos: bool
    seed: int | None = None  # per-request sampling seed (reproducible sampling)
    # MoE models: also return, per token, the experts it was routed to (routing replay)
    return_routed_experts: bool = False
    # deterministic runs: the built-in server computes this request alone in its forward
    # passes, so that its arithmetic does not depend on which requests share the batch
    deterministic: bool = False


@dataclasses.dataclass
class GenChunk:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int] | None  # None: the backend does not report versions
    stop_reason: str  # "stop" | "length" | "abort"
    # with GenParams.return_routed_experts: expert ids [prompt + new tokens - 1, n_moe_layers,
    # top_k] (or [rows, n_moe_layers * top_k] where the server sends them flat)
    routed_experts: Any = None


@dataclasses.dataclass
class HttpCall:
    path: str
    payload: dict[str, Any] | None = None
    method: str = "POST"


def stop_reason(x: Any) -> str:
    """A server's finish reason (a string, or a dict with ``type``) as ``"stop"``,
    ``"length"`` or ``"abort"`` (no reason, cancelled or interrupted: ``"abort"``, so the
    client resumes the request)."""
    if isinstance(x, dict):
        x = x.get("type")
    if x in ("stop", "length", "abort"):
        return x
    return "abort" if x in (None, "cancelled", "interrupt") else "stop"


class BackendAdapter:
    """Maps engine operations to one server protocol. Subclasses fill in the payloads."""

    name = "base"
    health_path = "/health"
    reports_versions = False

    def generate_call(self, rid: str, input_ids: list[int], p: GenParams) -> HttpCall:
        raise NotImplementedError

    def parse_generate(self, data: dict[str, Any]) -> GenChunk:
        raise NotImplementedError

    def with_images(
        self, call: HttpCall, image_data: list[Any], messages: list[dict] | None
    ) -> HttpCall:
        """The generate call ``call`` of a request with images, in this backend's format
        (``messages``: the chat messages, for servers that render the template)."""
        raise ValueError(f"backend {self.name!r} does not take images; use local, sglang or vllm")

    def updates_in_flight(self, meta: WeightUpdateMeta) -> bool:
        """Whether this server loads the update ``meta`` beside the live weights and swaps
        them in at commit, so generation need not pause (default: no)."""
        return False

    def pause_call(self) -> HttpCall:
        raise NotImplementedError(f"backend {self.name!r} cannot pause generation")

    def resume_call(self) -> HttpCall:
        raise NotImplementedError(f"backend {self.name!r} cannot resume generation")

    def update_disk_call(self, path: str, version: int | None) -> HttpCall:
        raise NotImplementedError(f"backend {self.name!r} cannot reload weights from disk")

    def update_delta_call(self, path: str, version: int) -> HttpCall | None:
        """Apply the weight delta in ``path`` (``areal.infra.weights.delta``) as pending
        ``version``; None: this server has no delta route (full updates only)."""
        return None

    def init_group_call(self, meta: WeightUpdateMeta, rank: int, world_size: int) -> HttpCall:
        raise NotImplementedError(f"backend {self.name!r} has no distributed weight update")

    def update_distributed_call(
        self, meta: WeightUpdateMeta, specs: list[ParamSpec], version: int | None
    ) -> HttpCall:
        raise NotImplementedError(f"backend {self.name!r} has no distributed weight update")

    def set_version_call(self, version: int) -> HttpCall | None:
        """None: the server does not track versions (the client does)."""
        return None

    def cpu_threads_call(self, threads: int) -> HttpCall | None:
        """Set the server's torch CPU threads (None: the server's are fixed at launch)."""
        return None

    def commit_call(self, version: int) -> HttpCall | None:
        """Make the pending weights current as ``version`` (default: the version call;
        None: nothing to tell the server)."""
        return self.set_version_call(version)

    def rollback_call(self, previous_path: str | None) -> HttpCall | None:
        """Serve the weights held before the pending update again (default: reload
        ``previous_path``; None: this server cannot, it leaves the rotation)."""
        return None if previous_path is None else self.update_disk_call(previous_path, None)


class HttpError(RuntimeError):
    def __init__(self, status: int, message: str, address: str):
        super().__init__(f"HTTP {status} from {address}: {message}")
        self.status = status


class NoHealthyServerError(RuntimeError):
    pass


class ServerLeftRotationError(ConnectionError):
    """The server of an in-flight request was taken out of rotation (hung or dead)."""
