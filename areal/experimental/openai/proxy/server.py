"""The OpenAI-compatible proxy: sessions, recorded model calls, export (AReaL's paths).

Agent programs written against the OpenAI (or Anthropic) SDK talk to this server; every
model call is served by an :class:`~areal.experimental.openai.ArealOpenAI` client over
the inference engine and recorded, token-exactly, in the calling session's
:class:`~areal.experimental.openai.cache.InteractionCache`.

Endpoints (every path also answers under ``/v1``, so both ``base_url=http://host:port``
and ``.../v1`` work with the OpenAI SDK; the Anthropic SDK calls ``/v1/messages``):

========================  =========  ==================================================
path                      key        what
========================  =========  ==================================================
``/health``               none       liveness
``/rl/start_session``     admin      ``{task_id, api_key?}`` -> ``{session_id, api_key,
                                     group_id, sessions: [{session_id,
                                     session_api_key}]}`` (the last two: AReaL 2.0's
                                     v2 gateway shape; HTTP 200, or 201 with
                                     ``start_session_status=201``, as 2.0's v2
                                     gateway answers); a live session's key: refresh
``/rl/set_reward``        session    ``{interaction_id?, reward}`` (None: the last call)
``/rl/end_session``       session    the session is final; its key is revoked
``/export_trajectories``  admin      ``{session_id, discount, style}``: waits for the
                                     end, applies the turn discount once, returns the
                                     serialized interactions and forgets the session
``/chat/completions``     session    OpenAI Chat Completions (``stream`` = SSE)
``/responses``            session    OpenAI Responses (no streaming)
``/v1/messages``          session    Anthropic Messages (``stream`` = Anthropic SSE)
``/grant_capacity``       admin      online mode: admit one more external session
``/internal/wait_for_session``  admin  online mode: wait for the session of a grant
========================  =========  ==================================================

Keys (:mod:`areal.utils.auth`): ``Authorization: Bearer <key>`` or ``x-api-key``. A
missing or unknown key is answered 401 before the body is read; a session key on an
admin endpoint is 401. Bodies are validated with pydantic: malformed JSON is 400, a
wrong shape 422, a request the model client rejects (``n > 1``, a bad message) 400; an
engine failure 500. None of them stops the server.

Online mode (``capacity_control=True``): ``/rl/start_session`` succeeds only against an
open grant (else 429); a grant is made by a trainer rollout task that the staleness
manager admitted, and that task waits for exactly the session started on its grant, so
external traffic never outruns the staleness bound.

Session refresh (AReaL's): ``/rl/start_session`` with the ``api_key`` of a live session
ends that session first (its last call gets reward 0 when it has none), which releases
its exporter (the trainer's rollout task in online mode), then starts the new session
bound to the same key. In online mode the new session waits up to ``refresh_timeout``
seconds for a grant (the trainer grants again once it has taken the old episode); past
that the answer is 429 and the old session stays ended. A second start with a key that
is being refreshed is 429.

Stop (``ProxyServer.stop``): sessions still held then (open, or ended and never
exported; e.g. the client's last session of an online run) are not trained on; they are
counted in ``/health``'s ``sessions_dropped_at_stop`` and logged with their ids.
"""

import asyncio
import math
import socket
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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
class _Slot:
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
        self.slots: OrderedDict[str, _Slot] = OrderedDict()
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
                raise _HttpError(429, "no capacity: the trainer admits no new session now")
        if api_key is not None:
            if auth.keys_equal(api_key, self.keys.admin_key):
                raise _HttpError(400, "the admin key cannot be a session key")
            if self.keys.session_of(api_key) is not None:
                raise _HttpError(409, "this api_key belongs to a live session")
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
            raise _HttpError(429, "a refresh is already in progress for this key")
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

    def open_slot(self) -> _Slot | None:
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
                raise _HttpError(
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
            raise _HttpError(410, f"session {session_id} already ended or expired")
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


class _HttpError(Exception):
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


# ============================================================================ the app
def create_app(state: ProxyState):
    """The FastAPI app: one router per API surface (session, OpenAI, Anthropic, online)."""
    # No ``from __future__ import annotations`` in this module: FastAPI reads the
    # handlers' ``Request`` annotations at runtime.
    from fastapi import APIRouter, FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    from areal.experimental.openai.proxy import anthropic_format

    app = FastAPI(title="areal OpenAI proxy", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = state

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(
            {"error": {"message": message, "type": kind, "code": status}}, status_code=status
        )

    @app.exception_handler(_HttpError)
    async def _http_error(request: Request, exc: _HttpError):
        return error(exc.status, exc.message)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.error("%s %s failed: %r", request.method, request.url.path, exc, exc_info=exc)
        return error(500, f"{type(exc).__name__}: {exc}", "server_error")

    def require(request: Request, need: str) -> auth.AuthResult:
        result = state.keys.check(request.headers, need=need)
        if result.ok and need == auth.SESSION and result.session_id is None:
            result = auth.AuthResult(False, reason="a session API key is required here")
        if not result.ok:
            peer = request.client.host if request.client else None
            auth.log_rejection(request.method, request.url.path, peer, result.reason, "proxy")
            raise _HttpError(401, f"unauthorized: {result.reason}")
        return result

    async def body(request: Request, model: type[BaseModel], allow_empty: bool = False):
        raw = await request.body()
        if not raw.strip() and allow_empty:
            raw = b"{}"
        try:
            return model.model_validate_json(raw)
        except ValidationError as e:
            errs = e.errors(include_url=False, include_context=False, include_input=False)
            if any(err.get("type") == "json_invalid" for err in errs):
                raise _HttpError(400, f"malformed JSON body: {errs[0].get('msg')}") from None
            raise _HttpError(422, f"invalid request body: {errs}") from None

    async def run_client(fn: Any, **kwargs: Any) -> Any:
        try:
            return await fn(**kwargs)
        except (ValueError, TypeError, KeyError) as e:
            raise _HttpError(400, f"{type(e).__name__}: {e}") from None

    sse_headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

    # ------------------------------------------------------------------ session router
    rl = APIRouter()

    @rl.get("/health")
    async def health():
        return {
            "status": "ok",
            "sessions": len(state.sessions),
            "open_grants": sum(s.session_id is None for s in state.slots.values()),
            **state.stats,
        }

    @rl.post(f"/{RL_START_SESSION_PATHNAME}")
    async def start_session(request: Request):
        require(request, auth.ADMIN)
        req = await body(request, StartSessionRequest, allow_empty=True)
        data = await state.start_or_refresh(req.task_id, req.api_key)
        answer = StartSessionResponse.of(data.session_id, data.api_key)
        return JSONResponse(answer.model_dump(), status_code=state.start_session_status)

    @rl.post(f"/{RL_SET_REWARD_PATHNAME}")
    async def set_reward(request: Request):
        who = require(request, auth.SESSION)
        req = await body(request, SetRewardRequest)
        data = state.session_for(who.session_id)
        if req.interaction_id is None and not data.cache:
            raise _HttpError(400, "no interactions in this session yet")
        iid = req.interaction_id or data.cache.last_interaction_id
        if iid not in data.cache:
            raise _HttpError(400, f"interaction {iid} not found in this session")
        data.cache.set_reward(iid, req.reward)
        return {"interaction_id": iid, "reward": req.reward}

    @rl.post(f"/{RL_END_SESSION_PATHNAME}")
    async def end_session(request: Request):
        who = require(request, auth.SESSION)
        data = state.session_for(who.session_id)
        state.end_session(data)
        n = len(data.cache)
        return {"session_id": data.session_id, "interactions": n, "interaction_count": n}

    @rl.post(f"/{EXPORT_TRAJECTORIES_PATHNAME}")
    async def export_trajectories(request: Request):
        require(request, auth.ADMIN)
        req = await body(request, ExportTrajectoriesRequest)
        data = state.sessions.get(req.session_id)
        if data is None:
            raise _HttpError(404, f"session {req.session_id} not found")
        await data.end_event.wait()
        try:
            if data.cache:
                interactions = data.cache.export_interactions(
                    req.style, reward_discount=req.discount
                )
            else:
                interactions = {}
            return {"interactions": serialize_interactions(interactions)}
        except ValueError as e:
            raise _HttpError(400, str(e)) from None
        finally:
            state.forget(req.session_id)

    # ------------------------------------------------------------------ online router
    online = APIRouter()

    @online.post(f"/{GRANT_CAPACITY_PATHNAME}")
    async def grant_capacity(request: Request):
        require(request, auth.ADMIN)
        slot = _Slot(slot_id=uuid.uuid4().hex)
        state.slots[slot.slot_id] = slot
        state.capacity_granted.set()
        return {
            "slot_id": slot.slot_id,
            "open": sum(s.session_id is None for s in state.slots.values()),
        }

    @online.post(f"/{INTERNAL_WAIT_FOR_SESSION_PATHNAME}")
    async def wait_for_session(request: Request):
        require(request, auth.ADMIN)
        req = await body(request, WaitForSessionRequest)
        slot = state.slots.get(req.slot_id)
        if slot is None:
            raise _HttpError(404, f"grant {req.slot_id} not found")

        async def wait() -> str:
            await slot.assigned.wait()
            await state.sessions[slot.session_id].end_event.wait()
            return slot.session_id

        waiter = asyncio.ensure_future(wait())
        stopper = asyncio.ensure_future(state.stopping.wait())
        try:
            done, _ = await asyncio.wait(
                {waiter, stopper}, timeout=req.timeout, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:
            if slot.session_id is None:  # caller gone before anyone used the grant
                state.slots.pop(req.slot_id, None)
            raise
        finally:
            waiter.cancel()
            stopper.cancel()
        if waiter in done:
            return {"session_id": waiter.result(), "slot_id": req.slot_id}
        if slot.session_id is None:
            state.slots.pop(req.slot_id, None)
        if stopper in done:
            raise _HttpError(503, "the proxy is stopping")
        raise _HttpError(408, "timeout waiting for the session of this grant")

    # ------------------------------------------------------------------ OpenAI router
    oai = APIRouter()

    def chat_kwargs(req: BaseModel) -> dict[str, Any]:
        kwargs = dict(req.model_extra or {})
        kwargs.pop("store", None)  # the proxy exists to record
        kwargs.pop("areal_cache", None)
        ctk = kwargs.pop("chat_template_kwargs", None)
        if ctk is not None:
            kwargs["extra_body"] = {"chat_template_kwargs": ctk}
        return kwargs

    async def chat_create(
        data: SessionData, messages: list, model: Any, stream: bool, kwargs: dict
    ):
        return await run_client(
            state.client.chat.completions.create,
            messages=messages,
            model=model,
            stream=stream,
            areal_cache=data.cache,
            **kwargs,
        )

    @oai.post(f"/{CHAT_COMPLETIONS_PATHNAME}")
    async def chat_completions(request: Request):
        who = require(request, auth.SESSION)
        req = await body(request, ChatCompletionRequest)
        data = state.session_for(who.session_id)
        out = await chat_create(data, req.messages, req.model, req.stream, chat_kwargs(req))
        if not req.stream:
            return JSONResponse(out.model_dump(mode="json", exclude_none=True))

        async def sse():
            async for chunk in out:
                yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers=sse_headers)

    @oai.post(f"/{RESPONSES_PATHNAME}")
    async def responses(request: Request):
        who = require(request, auth.SESSION)
        req = await body(request, ResponsesRequest)
        if req.stream:
            raise _HttpError(400, "stream=true is not supported on /responses")
        data = state.session_for(who.session_id)
        kwargs = chat_kwargs(req)
        out = await run_client(
            state.client.responses.create,
            input=req.input,
            model=req.model,
            areal_cache=data.cache,
            **kwargs,
        )
        return JSONResponse(out.model_dump(mode="json", exclude_none=True))

    # ------------------------------------------------------------------ Anthropic router
    ant = APIRouter()

    @ant.post(f"/{ANTHROPIC_MESSAGES_PATHNAME}")
    async def messages(request: Request):
        who = require(request, auth.SESSION)
        req = await body(request, AnthropicMessagesRequest)
        data = state.session_for(who.session_id)
        try:
            args = anthropic_format.anthropic_to_openai(req.model_dump())
        except (ValueError, TypeError, KeyError) as e:
            raise _HttpError(400, f"invalid Anthropic request: {e}") from None
        args.pop("model", None)
        completion = await chat_create(data, args.pop("messages"), req.model, False, args)
        message = anthropic_format.openai_to_anthropic(completion, req.model)
        if not req.stream:
            return JSONResponse(message)
        return StreamingResponse(
            anthropic_format.anthropic_sse(message),
            media_type="text/event-stream",
            headers=sse_headers,
        )

    for router in (rl, online, oai, ant):
        app.include_router(router)
    # Also under /v1 (OpenAI clients configured with a ".../v1" base URL).
    for router in (rl, online, oai):
        app.include_router(router, prefix="/v1")
    return app


# ============================================================================ running it
class ProxyServer:
    """Run the proxy app with uvicorn in a background thread of this process.

    ``base_url`` is ``http://<host>:<port>`` (the agent's ``base_url``). ``host`` is
    127.0.0.1 unless configured; ``port=0`` picks a free port.
    """

    def __init__(
        self,
        client: Any,
        admin_api_key: str = DEFAULT_ADMIN_API_KEY,
        host: str = "127.0.0.1",
        port: int = 0,
        session_timeout_seconds: float = SESSION_TIMEOUT_SECONDS,
        capacity_control: bool = False,
        refresh_timeout: float = REFRESH_TIMEOUT_SECONDS,
        start_session_status: int = 200,
    ):
        self.state = ProxyState(
            client,
            admin_api_key,
            session_timeout_seconds,
            capacity_control,
            refresh_timeout,
            start_session_status,
        )
        self.host = host
        self._port = port
        self._server = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dropped: set[str] = set()  # sessions counted by _count_dropped_sessions

    @property
    def admin_api_key(self) -> str:
        return self.state.keys.admin_key

    @property
    def port(self) -> int:
        if self._sock is None:
            raise RuntimeError("ProxyServer is not started")
        return self._sock.getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ProxyServer":
        import uvicorn

        if self._thread is not None:
            return self
        auth.refuse_default_key_off_loopback(
            self.host,
            self.admin_api_key,
            "the OpenAI proxy",
            f"rollout.agent.admin_api_key=<secret> or {auth.PROXY_ADMIN_KEY_ENV}",
        )
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto is
        # IPPROTO_TCP (accepted ones inherit it); with proto 0, Nagle plus delayed ACKs
        # added ~40 ms to every proxy call
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._port))
        self._sock = sock
        config = uvicorn.Config(
            create_app(self.state),
            log_level="warning",
            access_log=False,
            timeout_keep_alive=30,
            # Long polls (an online grant's wait, an export) never finish by themselves:
            # stopping cancels them after this grace instead of waiting out ``stop``.
            timeout_graceful_shutdown=1,
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        self._loop = asyncio.new_event_loop()
        serve = self._server.serve(sockets=[sock])
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(serve,), name="openai-proxy", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI proxy did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        logger.info("OpenAI proxy listening on %s", self.base_url)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Answer the open long polls (503), then shut the server down."""
        loop = self._loop
        if loop is not None and self._thread is not None and self._thread.is_alive():
            try:
                loop.call_soon_threadsafe(self.state.stopping.set)
                # one loop turn later the released handlers have answered
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(2.0)
            except (RuntimeError, TimeoutError):  # the loop is already closing
                pass
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
        if loop is not None and not loop.is_running():
            loop.close()
        self._loop = None
        self._thread = None
        self._server = None
        self._count_dropped_sessions()

    def _count_dropped_sessions(self) -> None:
        """Sessions still held at stop (open, or ended and never exported) are not
        trained on: counted in ``stats['sessions_dropped_at_stop']`` and logged."""
        left = [s for s in self.state.sessions.values() if s.session_id not in self._dropped]
        self._dropped.update(s.session_id for s in left)
        if not left:
            return
        self.state.stats["sessions_dropped_at_stop"] += len(left)
        n_open = sum(not s.ended for s in left)
        logger.warning(
            "proxy stopped with %d session(s) not exported for training (%d open, %d ended; "
            "%d model call(s)): dropped, sessions %s",
            len(left),
            n_open,
            len(left) - n_open,
            sum(len(s.cache) for s in left),
            [s.session_id for s in left],
        )

    def __enter__(self) -> "ProxyServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
