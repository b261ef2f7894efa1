"""``OpenAIProxyClient``: one RL session on the proxy, over HTTP (AReaL's name and methods).

::

    async with OpenAIProxyClient(http, base_url, task_id="t0", admin_api_key=key) as s:
        # hand s.session_api_key to the agent (its OpenAI/Anthropic client's api_key)
        await s.set_last_reward(1.0)
    interactions = await s.export_interactions(discount=0.9, style="individual")

Entering starts the session (admin key), leaving ends it (session key) even when the
body raised; :meth:`export_interactions` waits for the end, then returns
``{id: InteractionWithTokenLogpReward}`` rebuilt from the server's exact tensors.
``session`` is an ``httpx.AsyncClient`` (the same kind the OpenAI SDK takes as
``http_client``).
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from areal.experimental.openai.proxy.state import (
    EXPORT_TRAJECTORIES_PATHNAME,
    GRANT_CAPACITY_PATHNAME,
    INTERNAL_WAIT_FOR_SESSION_PATHNAME,
    RL_END_SESSION_PATHNAME,
    RL_SET_REWARD_PATHNAME,
    RL_START_SESSION_PATHNAME,
    deserialize_interactions,
)
from areal.utils import logging
from areal.utils.auth import auth_headers

logger = logging.getLogger("OpenAIProxyClient")


def import_httpx():
    """The HTTP client library the OpenAI SDK uses (``httpx2``, or ``httpx`` if older)."""
    try:
        import httpx2 as httpx
    except ImportError:  # SDK versions built on httpx
        import httpx
    return httpx


_RETRY_STATUS = (408, 429, 502, 503, 504)


class ProxyRequestError(RuntimeError):
    """The proxy answered an error status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"proxy answered {status}: {message}")
        self.status = status


async def post_json(
    session: Any,
    url: str,
    payload: dict[str, Any] | None = None,
    key: str | None = None,
    timeout: float | None = 30.0,
    retries: int = 3,
) -> dict[str, Any]:
    """POST JSON, return the JSON answer; retry connection errors and 408/429/5xx-gateway."""
    httpx = import_httpx()
    last: Exception | None = None
    for attempt in range(retries + 1):
        try:
            resp = await session.post(
                url, json=payload or {}, headers=auth_headers(key), timeout=timeout
            )
        except (httpx.TransportError, OSError) as e:
            last = e
        else:
            if resp.status_code < 400:
                return resp.json()
            last = ProxyRequestError(resp.status_code, resp.text[:500])
            if resp.status_code not in _RETRY_STATUS:
                raise last
        if attempt < retries:
            await asyncio.sleep(min(0.2 * 2**attempt, 2.0))
    assert last is not None
    raise last


class OpenAIProxyClient:
    """Session lifecycle on the proxy (see module docstring)."""

    def __init__(self, session: Any, base_url: str, task_id: str, admin_api_key: str):
        self._session = session
        self.base_url = base_url.rstrip("/") + "/"
        self.task_id = str(task_id)
        self._admin_api_key = admin_api_key
        self.session_id: str | None = None
        self._session_api_key: str | None = None

    @property
    def session_api_key(self) -> str:
        if self._session_api_key is None:
            raise ValueError("the session is not started: no session API key yet")
        return self._session_api_key

    async def start(self) -> None:
        data = await post_json(
            self._session,
            self.base_url + RL_START_SESSION_PATHNAME,
            {"task_id": self.task_id},
            key=self._admin_api_key,
        )
        self.session_id = data["session_id"]
        self._session_api_key = data["api_key"]

    async def end(self) -> None:
        await post_json(
            self._session, self.base_url + RL_END_SESSION_PATHNAME, key=self.session_api_key
        )

    async def set_reward(self, completion_id: str, reward: float) -> None:
        """Reward of one completion/response/message id of this session."""
        await post_json(
            self._session,
            self.base_url + RL_SET_REWARD_PATHNAME,
            {"interaction_id": completion_id, "reward": float(reward)},
            key=self.session_api_key,
        )

    async def set_last_reward(self, reward: float) -> None:
        """Reward of the most recent call of this session."""
        await post_json(
            self._session,
            self.base_url + RL_SET_REWARD_PATHNAME,
            {"reward": float(reward)},
            key=self.session_api_key,
        )

    async def export_interactions(
        self, discount: float = 1.0, style: str = "individual"
    ) -> dict[str, Any]:
        """The session's interactions (waits for the end; the server then forgets it)."""
        if self.session_id is None:
            raise ValueError("session_id must be set before exporting interactions")
        data = await post_json(
            self._session,
            self.base_url + EXPORT_TRAJECTORIES_PATHNAME,
            {"session_id": self.session_id, "discount": float(discount), "style": style},
            key=self._admin_api_key,
            timeout=None,
            retries=0,
        )
        return deserialize_interactions(data["interactions"])

    async def __aenter__(self) -> OpenAIProxyClient:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.session_id is None:
            return
        try:
            await self.end()
        except Exception as e:
            logger.warning("could not end session %s: %s", self.session_id, e)
            if exc is None:
                raise


async def grant_capacity(session: Any, base_url: str, admin_api_key: str) -> str:
    """Online mode: open one grant for an external session; returns its slot id."""
    data = await post_json(
        session, base_url.rstrip("/") + "/" + GRANT_CAPACITY_PATHNAME, key=admin_api_key
    )
    return data["slot_id"]


async def wait_for_session(
    session: Any, base_url: str, admin_api_key: str, slot_id: str, timeout: float | None = None
) -> str:
    """Online mode: wait until the session started on ``slot_id`` ended; its session id."""
    data = await post_json(
        session,
        base_url.rstrip("/") + "/" + INTERNAL_WAIT_FOR_SESSION_PATHNAME,
        {"slot_id": slot_id, "timeout": timeout},
        key=admin_api_key,
        timeout=None,
        retries=0,
    )
    return data["session_id"]
