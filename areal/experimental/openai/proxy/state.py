"""The proxy's state and wire types: request models, sessions, online grants
(:class:`ProxyState`), the serialized interactions the trainer reads back. The app over
it is ``routes.py``; running it, ``server.py`` (the endpoints are listed there)."""

import asyncio
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from areal.experimental.openai.cache import InteractionCache
from areal.utils import auth, logging

logger = logging.getLogger("OpenAIProxy")

# AReaL's path names (relative to the base URL).
RL_START_SESSION_PATHNAME = "rl/start_session"
RL_END_SESSION_PATHNAME = "rl/end_session"
RL_SET_REWARD_PATHNAME = "rl/set_reward"
CHAT_COMPLETIONS_PATHNAME = "chat/completions"
RESPONSES_PATHNAME = "responses"
ANTHROPIC_MESSAGES_PATHNAME = "v1/messages"
GRANT_CAPACITY_PATHNAME = "grant_capacity"
EXPORT_TRAJECTORIES_PATHNAME = "export_trajectories"
INTERNAL_WAIT_FOR_SESSION_PATHNAME = "internal/wait_for_session"

DEFAULT_ADMIN_API_KEY = "areal-admin-key"
SESSION_TIMEOUT_SECONDS = 3600
REFRESH_TIMEOUT_SECONDS = 120.0  # AReaL's gateway default


# ============================================================================ request models
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StartSessionRequest(_Strict):
    task_id: str = ""
    api_key: str | None = Field(None, description="Register this key instead of a fresh one.")


class StartSessionResponse(BaseModel):
    session_id: str
    api_key: str
    # AReaL 2.0's v2 inference gateway answers a group of sessions (one here)
    group_id: str
    sessions: list[dict[str, str]]

    @classmethod
    def of(cls, session_id: str, api_key: str) -> "StartSessionResponse":
        one = {"session_id": session_id, "session_api_key": api_key}
        return cls(session_id=session_id, api_key=api_key, group_id=session_id, sessions=[one])


class SetRewardRequest(_Strict):
    interaction_id: str | None = None
    reward: float

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"reward={v} is not finite")
        return v


class ExportTrajectoriesRequest(_Strict):
    session_id: str
    discount: float = Field(1.0, ge=0.0, le=1.0)
    style: Literal["individual", "concat"] = "individual"


class WaitForSessionRequest(_Strict):
    slot_id: str
    timeout: float | None = Field(None, gt=0)


class ChatCompletionRequest(BaseModel):
    """OpenAI Chat Completions body; fields beyond these go to the client as kwargs."""

    model_config = ConfigDict(extra="allow")
    messages: list[dict[str, Any]] = Field(min_length=1)
    model: str | None = None
    stream: bool = False


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    input: str | list[dict[str, Any]]
    model: str | None = None
    stream: bool = False


class AnthropicMessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool = False


# ============================================================================ sessions
@dataclass
class SessionData:
    """One RL session: its interactions and lifecycle (server-loop objects)."""

    session_id: str
    task_id: str
    api_key: str
    cache: InteractionCache = field(default_factory=InteractionCache)
    created: float = field(default_factory=time.time)
    last_access: float = field(default_factory=time.time)
    ended: bool = False
    slot_id: str | None = None
    end_event: asyncio.Event = field(default_factory=asyncio.Event)

    def touch(self) -> None:
        self.last_access = time.time()

    def finish(self) -> None:
        self.ended = True
        self.touch()
        self.end_event.set()


@dataclass
class Slot:
    """A grant of one external session (online mode)."""

    slot_id: str
    session_id: str | None = None
    assigned: asyncio.Event = field(default_factory=asyncio.Event)


class ProxyState:
    """Everything the app serves: the model client, keys, sessions, online grants."""

    def __init__(
        self,
        client: Any,
        admin_api_key: str = DEFAULT_ADMIN_API_KEY,
        session_timeout_seconds: float = SESSION_TIMEOUT_SECONDS,
        capacity_control: bool = False,
        refresh_timeout: float = REFRESH_TIMEOUT_SECONDS,
        start_session_status: int = 200,
    ):
        if not admin_api_key or not admin_api_key.strip():
            raise ValueError("admin_api_key must be a non-blank string")
        if start_session_status not in (200, 201):
            raise ValueError(f"start_session_status={start_session_status}; allowed: 200, 201")
        self.start_session_status = start_session_status
        if session_timeout_seconds <= 0:
            raise ValueError(f"session_timeout_seconds={session_timeout_seconds}; must be > 0")
        if refresh_timeout <= 0:
            raise ValueError(f"refresh_timeout={refresh_timeout}; must be > 0")
        self.refresh_timeout = float(refresh_timeout)
        self.refreshing: set[str] = set()  # keys whose refresh is under way
        self.capacity_granted = asyncio.Event()  # set by each grant (refresh waits on it)
        self.stopping = asyncio.Event()  # set by ProxyServer.stop: long polls answer 503
        self.client = client
        self.keys = auth.KeyRing(admin_api_key)
        self.sessions: dict[str, SessionData] = {}
        self.session_timeout_seconds = float(session_timeout_seconds)
        self.capacity_control = capacity_control
        self.slots: OrderedDict[str, Slot] = OrderedDict()
        self.stats = {
            "sessions_started": 0,
            "sessions_ended": 0,
            "sessions_expired": 0,
            "sessions_refreshed": 0,
            "sessions_dropped_at_stop": 0,
        }

    # ------------------------------------------------------------------ lifecycle
    def start_session(self, task_id: str, api_key: str | None) -> SessionData:
        self.drop_expired()
        slot = None
        if self.capacity_control:
            slot = self.open_slot()
            if slot is None:
                raise ProxyHttpError(429, "no capacity: the trainer admits no new session now")
        if api_key is not None:
            if auth.keys_equal(api_key, self.keys.admin_key):
                raise ProxyHttpError(400, "the admin key cannot be a session key")
            if self.keys.session_of(api_key) is not None:
                raise ProxyHttpError(409, "this api_key belongs to a live session")
        session_id = f"{task_id or 'session'}-{uuid.uuid4().hex[:12]}"
        key = self.keys.issue(session_id, api_key)
        data = SessionData(session_id=session_id, task_id=task_id, api_key=key)
        if slot is not None:
            slot.session_id = session_id
            data.slot_id = slot.slot_id
            slot.assigned.set()
        self.sessions[session_id] = data
        self.stats["sessions_started"] += 1
        return data

    async def start_or_refresh(self, task_id: str, api_key: str | None) -> SessionData:
        """``start_session``, or a refresh when ``api_key`` is a live session's (module doc)."""
        if api_key is None or auth.keys_equal(api_key, self.keys.admin_key):
            return self.start_session(task_id, api_key)
        if api_key in self.refreshing:
            raise ProxyHttpError(429, "a refresh is already in progress for this key")
        live = self.sessions.get(self.keys.session_of(api_key) or "")
        if live is None:
            return self.start_session(task_id, api_key)
        self.refreshing.add(api_key)
        try:
            if live.cache and live.cache[live.cache.last_interaction_id].reward is None:
                live.cache.set_last_reward(0.0)
            self.end_session(live)
            self.stats["sessions_refreshed"] += 1
            logger.info(
                "refresh: session %s ended (%d interactions); the key moves to a new session",
                live.session_id,
                len(live.cache),
            )
            await self.wait_for_capacity(self.refresh_timeout)
            return self.start_session(task_id, api_key)
        finally:
            self.refreshing.discard(api_key)

    def open_slot(self) -> Slot | None:
        return next((s for s in self.slots.values() if s.session_id is None), None)

    async def wait_for_capacity(self, timeout: float) -> None:
        """Online mode: return once a grant is open; 429 after ``timeout`` seconds."""
        if not self.capacity_control:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.open_slot() is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ProxyHttpError(
                    429,
                    f"refresh timed out ({timeout:.0f}s without capacity from the trainer); "
                    "the old session was ended: retry to start a new one",
                )
            self.capacity_granted.clear()
            try:
                await asyncio.wait_for(self.capacity_granted.wait(), remaining)
            except TimeoutError:
                pass

    def session_for(self, session_id: str | None) -> SessionData:
        data = self.sessions.get(session_id or "")
        if data is None:
            raise ProxyHttpError(410, f"session {session_id} already ended or expired")
        data.touch()
        return data

    def end_session(self, data: SessionData) -> None:
        self.keys.revoke_session(data.session_id)
        data.finish()
        self.stats["sessions_ended"] += 1

    def forget(self, session_id: str) -> None:
        data = self.sessions.pop(session_id, None)
        if data is not None:
            self.keys.revoke_session(session_id)
            if data.slot_id is not None:
                self.slots.pop(data.slot_id, None)

    def drop_expired(self) -> None:
        now = time.time()
        for sid, data in list(self.sessions.items()):
            if now - data.last_access > self.session_timeout_seconds:
                logger.warning(
                    "session %s idle for %.0fs (> %.0fs): dropped",
                    sid,
                    now - data.last_access,
                    self.session_timeout_seconds,
                )
                self.stats["sessions_expired"] += 1
                if not data.ended:
                    data.finish()  # an exporter waiting on it gets what was recorded
                self.keys.revoke_session(sid)
                if data.slot_id is None:
                    self.sessions.pop(sid, None)


class ProxyHttpError(Exception):
    """An HTTP error answer of the proxy (status and message)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# ============================================================================ serialization
def serialize_interactions(interactions: dict[str, Any]) -> dict[str, Any]:
    """JSON-able ``{id: {tensor_dict, reward, interaction_id}}`` (tensors as typed lists)."""
    out: dict[str, Any] = {}
    for key, it in interactions.items():
        tensors = {
            name: {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "data": t.reshape(-1).tolist(),
            }
            for name, t in it.to_tensor_dict().items()
            if name != "rewards"
        }
        out[key] = {
            "tensor_dict": tensors,
            "reward": it.reward,
            "interaction_id": it.interaction_id,
        }
    return out


def deserialize_interactions(data: dict[str, Any]) -> dict[str, Any]:
    """``{id: InteractionWithTokenLogpReward}`` whose ``to_tensor_dict()`` is the server's row."""
    import torch

    from areal.experimental.openai.types import InteractionWithTokenLogpReward

    out: dict[str, Any] = {}
    for key, item in data.items():
        it = InteractionWithTokenLogpReward()
        it._cache = {
            name: torch.tensor(t["data"], dtype=getattr(torch, t["dtype"])).reshape(t["shape"])
            for name, t in item["tensor_dict"].items()
        }
        it.reward = item["reward"]
        it.interaction_id = item["interaction_id"]
        out[key] = it
    return out
