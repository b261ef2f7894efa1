"""The proxy's FastAPI app: module-level handlers grouped by route family.

- session (``/health``, ``/rl/start_session``, ``/rl/set_reward``, ``/rl/end_session``,
  ``/export_trajectories``);
- online grants (``/grant_capacity``, ``/internal/wait_for_session``);
- OpenAI (``/chat/completions``, ``/responses``);
- Anthropic (``/v1/messages``).

Every handler reads the :class:`~areal.experimental.openai.proxy.state.ProxyState` from
``request.app.state.proxy``; the endpoint table is in ``server.py``'s docstring.
"""

# No ``from __future__ import annotations`` in this module: FastAPI reads the handlers'
# ``Request`` annotations at runtime.

import asyncio
import uuid
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from areal.experimental.openai.proxy.state import (
    ANTHROPIC_MESSAGES_PATHNAME,
    CHAT_COMPLETIONS_PATHNAME,
    EXPORT_TRAJECTORIES_PATHNAME,
    GRANT_CAPACITY_PATHNAME,
    INTERNAL_WAIT_FOR_SESSION_PATHNAME,
    RESPONSES_PATHNAME,
    RL_END_SESSION_PATHNAME,
    RL_SET_REWARD_PATHNAME,
    RL_START_SESSION_PATHNAME,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    ExportTrajectoriesRequest,
    ProxyHttpError,
    ProxyState,
    ResponsesRequest,
    SessionData,
    SetRewardRequest,
    Slot,
    StartSessionRequest,
    StartSessionResponse,
    WaitForSessionRequest,
    serialize_interactions,
)
from areal.utils import auth, logging

logger = logging.getLogger("OpenAIProxy")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(state: ProxyState):
    """The FastAPI app over ``state``: one router per route family, each also under
    ``/v1`` (OpenAI clients configured with a ``.../v1`` base URL) but Anthropic's."""
    from fastapi import FastAPI

    app = FastAPI(title="areal OpenAI proxy", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = state
    app.add_exception_handler(ProxyHttpError, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    session, online, openai, anthropic = (
        session_router(),
        online_router(),
        openai_router(),
        anthropic_router(),
    )
    for router in (session, online, openai, anthropic):
        app.include_router(router)
    for router in (session, online, openai):
        app.include_router(router, prefix="/v1")
    return app


# ============================================================================ shared
def error_response(status: int, message: str, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )


async def _http_error(request: Request, exc: ProxyHttpError):
    return error_response(exc.status, exc.message)


async def _unexpected(request: Request, exc: Exception):
    logger.error("%s %s failed: %r", request.method, request.url.path, exc, exc_info=exc)
    return error_response(500, f"{type(exc).__name__}: {exc}", "server_error")


def proxy_state(request: Request) -> ProxyState:
    return request.app.state.proxy


def require(request: Request, need: str) -> auth.AuthResult:
    """The request's key checked for ``need`` (admin / session); 401 otherwise."""
    result = proxy_state(request).keys.check(request.headers, need=need)
    if result.ok and need == auth.SESSION and result.session_id is None:
        result = auth.AuthResult(False, reason="a session API key is required here")
    if not result.ok:
        peer = request.client.host if request.client else None
        auth.log_rejection(request.method, request.url.path, peer, result.reason, "proxy")
        raise ProxyHttpError(401, f"unauthorized: {result.reason}")
    return result


async def read_body(request: Request, model: type[BaseModel], allow_empty: bool = False):
    """The body validated as ``model``: malformed JSON 400, a wrong shape 422."""
    raw = await request.body()
    if not raw.strip() and allow_empty:
        raw = b"{}"
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errs = e.errors(include_url=False, include_context=False, include_input=False)
        if any(err.get("type") == "json_invalid" for err in errs):
            raise ProxyHttpError(400, f"malformed JSON body: {errs[0].get('msg')}") from None
        raise ProxyHttpError(422, f"invalid request body: {errs}") from None


async def run_client(fn: Any, **kwargs: Any) -> Any:
    """A model-client call; a request the client rejects is a 400."""
    try:
        return await fn(**kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise ProxyHttpError(400, f"{type(e).__name__}: {e}") from None


def _router(routes: list[tuple[str, Any, str]]):
    from fastapi import APIRouter

    router = APIRouter()
    for path, handler, method in routes:
        router.add_api_route(path, handler, methods=[method])
    return router


# ============================================================================ session
async def health(request: Request):
    state = proxy_state(request)
    return {
        "status": "ok",
        "sessions": len(state.sessions),
        "open_grants": sum(s.session_id is None for s in state.slots.values()),
        **state.stats,
    }


async def start_session(request: Request):
    from fastapi.responses import JSONResponse

    state = proxy_state(request)
    require(request, auth.ADMIN)
    req = await read_body(request, StartSessionRequest, allow_empty=True)
    data = await state.start_or_refresh(req.task_id, req.api_key)
    answer = StartSessionResponse.of(data.session_id, data.api_key)
    return JSONResponse(answer.model_dump(), status_code=state.start_session_status)


async def set_reward(request: Request):
    who = require(request, auth.SESSION)
    req = await read_body(request, SetRewardRequest)
    data = proxy_state(request).session_for(who.session_id)
    if req.interaction_id is None and not data.cache:
        raise ProxyHttpError(400, "no interactions in this session yet")
    iid = req.interaction_id or data.cache.last_interaction_id
    if iid not in data.cache:
        raise ProxyHttpError(400, f"interaction {iid} not found in this session")
    data.cache.set_reward(iid, req.reward)
    return {"interaction_id": iid, "reward": req.reward}


async def end_session(request: Request):
    who = require(request, auth.SESSION)
    state = proxy_state(request)
    data = state.session_for(who.session_id)
    state.end_session(data)
    n = len(data.cache)
    return {"session_id": data.session_id, "interactions": n, "interaction_count": n}


async def export_trajectories(request: Request):
    require(request, auth.ADMIN)
    state = proxy_state(request)
    req = await read_body(request, ExportTrajectoriesRequest)
    data = state.sessions.get(req.session_id)
    if data is None:
        raise ProxyHttpError(404, f"session {req.session_id} not found")
    await data.end_event.wait()
    try:
        if data.cache:
            interactions = data.cache.export_interactions(req.style, reward_discount=req.discount)
        else:
            interactions = {}
        return {"interactions": serialize_interactions(interactions)}
    except ValueError as e:
        raise ProxyHttpError(400, str(e)) from None
    finally:
        state.forget(req.session_id)


def session_router():
    return _router(
        [
            ("/health", health, "GET"),
            (f"/{RL_START_SESSION_PATHNAME}", start_session, "POST"),
            (f"/{RL_SET_REWARD_PATHNAME}", set_reward, "POST"),
            (f"/{RL_END_SESSION_PATHNAME}", end_session, "POST"),
            (f"/{EXPORT_TRAJECTORIES_PATHNAME}", export_trajectories, "POST"),
        ]
    )


# ============================================================================ online grants
async def grant_capacity(request: Request):
    require(request, auth.ADMIN)
    state = proxy_state(request)
    slot = Slot(slot_id=uuid.uuid4().hex)
    state.slots[slot.slot_id] = slot
    state.capacity_granted.set()
    return {
        "slot_id": slot.slot_id,
        "open": sum(s.session_id is None for s in state.slots.values()),
    }


async def wait_for_session(request: Request):
    """Wait for the session started on a grant to end (408 at the timeout, 503 when the
    proxy stops); a grant nobody used is withdrawn."""
    require(request, auth.ADMIN)
    state = proxy_state(request)
    req = await read_body(request, WaitForSessionRequest)
    slot = state.slots.get(req.slot_id)
    if slot is None:
        raise ProxyHttpError(404, f"grant {req.slot_id} not found")

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
        raise ProxyHttpError(503, "the proxy is stopping")
    raise ProxyHttpError(408, "timeout waiting for the session of this grant")


def online_router():
    return _router(
        [
            (f"/{GRANT_CAPACITY_PATHNAME}", grant_capacity, "POST"),
            (f"/{INTERNAL_WAIT_FOR_SESSION_PATHNAME}", wait_for_session, "POST"),
        ]
    )


# ============================================================================ OpenAI
def chat_kwargs(req: BaseModel) -> dict[str, Any]:
    """The request's extra fields as model-client kwargs (``store`` dropped: the proxy
    exists to record; ``chat_template_kwargs`` passed in ``extra_body``)."""
    kwargs = dict(req.model_extra or {})
    kwargs.pop("store", None)
    kwargs.pop("areal_cache", None)
    ctk = kwargs.pop("chat_template_kwargs", None)
    if ctk is not None:
        kwargs["extra_body"] = {"chat_template_kwargs": ctk}
    return kwargs


async def chat_create(
    state: ProxyState, data: SessionData, messages: list, model: Any, stream: bool, kwargs: dict
):
    return await run_client(
        state.client.chat.completions.create,
        messages=messages,
        model=model,
        stream=stream,
        areal_cache=data.cache,
        **kwargs,
    )


async def chat_completions(request: Request):
    from fastapi.responses import JSONResponse, StreamingResponse

    who = require(request, auth.SESSION)
    state = proxy_state(request)
    req = await read_body(request, ChatCompletionRequest)
    data = state.session_for(who.session_id)
    out = await chat_create(state, data, req.messages, req.model, req.stream, chat_kwargs(req))
    if not req.stream:
        return JSONResponse(out.model_dump(mode="json", exclude_none=True))

    async def sse():
        async for chunk in out:
            yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream", headers=SSE_HEADERS)


async def responses(request: Request):
    from fastapi.responses import JSONResponse

    who = require(request, auth.SESSION)
    state = proxy_state(request)
    req = await read_body(request, ResponsesRequest)
    if req.stream:
        raise ProxyHttpError(400, "stream=true is not supported on /responses")
    data = state.session_for(who.session_id)
    out = await run_client(
        state.client.responses.create,
        input=req.input,
        model=req.model,
        areal_cache=data.cache,
        **chat_kwargs(req),
    )
    return JSONResponse(out.model_dump(mode="json", exclude_none=True))


def openai_router():
    return _router(
        [
            (f"/{CHAT_COMPLETIONS_PATHNAME}", chat_completions, "POST"),
            (f"/{RESPONSES_PATHNAME}", responses, "POST"),
        ]
    )


# ============================================================================ Anthropic
async def messages(request: Request):
    """Anthropic Messages over the chat client (converted both ways)."""
    from fastapi.responses import JSONResponse, StreamingResponse

    from areal.experimental.openai.proxy import anthropic_format

    who = require(request, auth.SESSION)
    state = proxy_state(request)
    req = await read_body(request, AnthropicMessagesRequest)
    data = state.session_for(who.session_id)
    try:
        args = anthropic_format.anthropic_to_openai(req.model_dump())
    except (ValueError, TypeError, KeyError) as e:
        raise ProxyHttpError(400, f"invalid Anthropic request: {e}") from None
    args.pop("model", None)
    completion = await chat_create(state, data, args.pop("messages"), req.model, False, args)
    message = anthropic_format.openai_to_anthropic(completion, req.model)
    if not req.stream:
        return JSONResponse(message)
    return StreamingResponse(
        anthropic_format.anthropic_sse(message),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


def anthropic_router():
    return _router([(f"/{ANTHROPIC_MESSAGES_PATHNAME}", messages, "POST")])
