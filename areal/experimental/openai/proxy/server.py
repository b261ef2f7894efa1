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

The state and wire types are in ``state.py``; the app, its handlers by route family, in
``routes.py``; this module runs it (:class:`ProxyServer`: uvicorn in a thread).

Stop (``ProxyServer.stop``): sessions still held then (open, or ended and never
exported; e.g. the client's last session of an online run) are not trained on; they are
counted in ``/health``'s ``sessions_dropped_at_stop`` and logged with their ids.
"""

import asyncio
import socket
import threading
import time
from typing import Any

from areal.experimental.openai.proxy.state import (
    DEFAULT_ADMIN_API_KEY,
    REFRESH_TIMEOUT_SECONDS,
    SESSION_TIMEOUT_SECONDS,
    ProxyState,
)
from areal.utils import auth, logging

logger = logging.getLogger("OpenAIProxy")


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

        from areal.experimental.openai.proxy import routes

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
            routes.create_app(self.state),
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
