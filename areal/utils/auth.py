"""Shared-secret authentication for every HTTP surface areal starts.

One module for all of them: the control plane (RPC workers, inference-server control
endpoints such as weight updates, pause/continue, abort) and the agent proxy (admin key,
per-session API keys). Keys travel in a header, never in a URL or a command line:

- ``Authorization: Bearer <key>`` (OpenAI SDK style), or
- ``x-api-key: <key>`` (Anthropic SDK style).

The controller creates one secret per run (:func:`ensure_run_secret`) and hands it to
the processes it starts through the environment (:data:`RUN_SECRET_ENV`); a process
reads it with :func:`get_run_secret`. Comparisons are constant-time. A rejected request
is logged (method, path, peer, reason: never the key) and answered 401 before its body
is read, so nothing is unpickled or executed for it.

Framework adapters: :func:`aiohttp_middleware` (aiohttp apps) and
:func:`fastapi_dependency` (FastAPI routes).

Admin keys of the agent proxy and its gateway: the well-known default
(:data:`DEFAULT_ADMIN_KEY`) is refused on any address other than loopback
(:func:`refuse_default_key_off_loopback`, called before a socket is opened); a surface
started with no key gets a random one written to a file only its user can read
(:func:`generate_admin_key_file`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from areal.utils import logging

logger = logging.getLogger("Auth")

#: Environment variable carrying the per-run control-plane secret.
RUN_SECRET_ENV = "AREAL_RUN_SECRET"

#: Scopes a key can grant: ``admin`` (management/control endpoints) or ``session``.
ADMIN = "admin"
SESSION = "session"


def new_key(prefix: str = "") -> str:
    """A fresh random key (256 bits, URL-safe), optionally prefixed (e.g. ``"sk-sess-"``)."""
    return prefix + secrets.token_urlsafe(32)


def get_run_secret(env: Mapping[str, str] | None = None) -> str | None:
    """The run secret from the environment, or ``None`` when this run has none."""
    value = (env if env is not None else os.environ).get(RUN_SECRET_ENV, "")
    return value or None


def ensure_run_secret() -> str:
    """Return this run's secret, creating it (and exporting it to children) if absent."""
    secret = get_run_secret()
    if secret is None:
        secret = new_key()
        os.environ[RUN_SECRET_ENV] = secret
    return secret


def auth_headers(key: str | None) -> dict[str, str]:
    """Headers that authenticate a request with ``key`` (empty when ``key`` is None)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def extract_key(headers: Mapping[str, str]) -> str | None:
    """The key a request presents (``Authorization: Bearer`` or ``x-api-key``), if any."""
    auth = _get_header(headers, "authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = _get_header(headers, "x-api-key")
    return key.strip() if key and key.strip() else None


def keys_equal(a: str | None, b: str | None) -> bool:
    """Constant-time comparison; ``None`` or empty never matches."""
    if not a or not b:
        return False
    return hmac.compare_digest(a.encode(), b.encode())


def _get_header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        value = headers.get(name.title())
    if value is None:
        for k, v in headers.items():
            if k.lower() == name:
                return v
    return value


@dataclass(frozen=True)
class AuthResult:
    """Outcome of checking one request: ``ok``, the granted ``scope``, the session id."""

    ok: bool
    scope: str | None = None
    session_id: str | None = None
    reason: str = ""


class KeyRing:
    """An admin key plus per-session keys; thread-safe.

    ``check(headers, need=ADMIN)`` accepts only the admin key; ``need=SESSION`` accepts
    a live session key (and the admin key, which may act on any session).
    """

    def __init__(self, admin_key: str | None = None):
        self.admin_key = admin_key or new_key("sk-admin-")
        self._sessions: dict[str, str] = {}
        self._lock = threading.Lock()

    def issue(self, session_id: str, key: str | None = None) -> str:
        """Create (or register a given) key for ``session_id`` and return it."""
        key = key or new_key("sk-sess-")
        with self._lock:
            self._sessions[key] = session_id
        return key

    def revoke(self, key: str) -> None:
        with self._lock:
            self._sessions.pop(key, None)

    def revoke_session(self, session_id: str) -> None:
        with self._lock:
            for k in [k for k, s in self._sessions.items() if s == session_id]:
                del self._sessions[k]

    def session_of(self, key: str | None) -> str | None:
        if not key:
            return None
        with self._lock:
            for k, sid in self._sessions.items():
                if keys_equal(k, key):
                    return sid
        return None

    def check(self, headers: Mapping[str, str], need: str = SESSION) -> AuthResult:
        key = extract_key(headers)
        if key is None:
            return AuthResult(False, reason="no API key (Authorization: Bearer ... or x-api-key)")
        if keys_equal(key, self.admin_key):
            return AuthResult(True, scope=ADMIN)
        if need == ADMIN:
            return AuthResult(False, reason="admin key required")
        sid = self.session_of(key)
        if sid is None:
            return AuthResult(False, reason="unknown or revoked API key")
        return AuthResult(True, scope=SESSION, session_id=sid)


def check_secret(headers: Mapping[str, str], secret: str | None) -> AuthResult:
    """Check a request against a single shared secret (control plane).

    With ``secret=None`` (authentication disabled) every request passes.
    """
    if secret is None:
        return AuthResult(True, scope=ADMIN)
    key = extract_key(headers)
    if key is None:
        return AuthResult(False, reason="missing run secret")
    if not keys_equal(key, secret):
        return AuthResult(False, reason="wrong run secret")
    return AuthResult(True, scope=ADMIN)


def log_rejection(method: str, path: str, peer: Any, reason: str, surface: str = "") -> None:
    where = f"{surface} " if surface else ""
    logger.warning(f"{where}401 {method} {path} from {peer}: {reason}")


def aiohttp_middleware(
    check: Callable[[Mapping[str, str]], AuthResult],
    protected: Callable[[str], bool] | Iterable[str] | None = None,
    surface: str = "",
):
    """aiohttp middleware answering 401 (JSON body) before the handler reads anything.

    ``protected``: a predicate on the request path, or an iterable of paths; ``None``
    protects every path.
    """
    from aiohttp import web

    is_protected = _path_predicate(protected)

    @web.middleware
    async def middleware(request, handler):
        if is_protected(request.path):
            result = check(request.headers)
            if not result.ok:
                log_rejection(request.method, request.path, request.remote, result.reason, surface)
                return web.json_response(
                    {"error": {"message": f"unauthorized: {result.reason}", "code": 401}},
                    status=401,
                )
            request[_auth_key()] = result
        return await handler(request)

    return middleware


def _make_auth_key():
    try:
        from aiohttp import web
    except ImportError:  # pragma: no cover - aiohttp is a core dependency
        return None
    return web.RequestKey("areal_auth", AuthResult)


# Created at import: aiohttp names a RequestKey after the module found on the caller's
# stack, and fails when created from a thread without one (e.g. a Ray actor's server thread).
_AUTH_KEY = _make_auth_key()


def _auth_key():
    """The aiohttp ``RequestKey`` under which the middleware stores the AuthResult."""
    return _AUTH_KEY


def request_auth(request) -> AuthResult | None:
    """The AuthResult the aiohttp middleware attached to ``request`` (None if unprotected)."""
    return request.get(_auth_key())


def fastapi_dependency(check: Callable[[Mapping[str, str]], AuthResult], surface: str = ""):
    """A FastAPI dependency raising 401 unless ``check`` accepts; returns the AuthResult."""
    from fastapi import HTTPException, Request

    async def dependency(request: Request) -> AuthResult:
        result = check(request.headers)
        if not result.ok:
            peer = request.client.host if request.client else None
            log_rejection(request.method, request.url.path, peer, result.reason, surface)
            raise HTTPException(status_code=401, detail=f"unauthorized: {result.reason}")
        return result

    return dependency


def _path_predicate(protected: Callable[[str], bool] | Iterable[str] | None) -> Callable:
    if protected is None:
        return lambda path: True
    if callable(protected):
        return protected
    paths = frozenset(protected)
    return lambda path: path in paths


#: Environment variable with the API key generation endpoints of the built-in server
#: require (``InferenceEngineConfig.api_key_env`` names where the controller reads it).
SERVER_API_KEY_ENV = "AREAL_SERVER_API_KEY"


def check_secret_or_key(
    headers: Mapping[str, str], secret: str | None, api_key: str | None
) -> AuthResult:
    """Accept the run secret (scope ``admin``) or ``api_key`` (scope ``session``).

    With ``api_key=None`` the check passes every request (generation left open).
    """
    if api_key is None:
        return AuthResult(True, scope=SESSION)
    key = extract_key(headers)
    if key is None:
        return AuthResult(False, reason="missing API key")
    if keys_equal(key, secret):
        return AuthResult(True, scope=ADMIN)
    if keys_equal(key, api_key):
        return AuthResult(True, scope=SESSION)
    return AuthResult(False, reason="wrong API key")


def server_middleware(
    control_paths: Iterable[str],
    secret: str | None,
    api_key: str | None = None,
    surface: str = "",
):
    """aiohttp middleware of an inference server: control paths need the run secret; all
    other paths except ``/health``, ``/metrics`` and the version reads need ``api_key``
    (or the run secret) when ``api_key`` is set."""
    control = frozenset(control_paths)
    open_paths = frozenset({"/health", "/metrics", "/version", "/get_version", "/is_paused"})

    def check(headers: Mapping[str, str], path: str) -> AuthResult:
        if path in control:
            return check_secret(headers, secret)
        if path in open_paths:
            return AuthResult(True)
        return check_secret_or_key(headers, secret, api_key)

    from aiohttp import web

    @web.middleware
    async def middleware(request, handler):
        result = check(request.headers, request.path)
        if not result.ok:
            log_rejection(request.method, request.path, request.remote, result.reason, surface)
            return web.json_response(
                {"error": {"message": f"unauthorized: {result.reason}", "code": 401}},
                status=401,
            )
        return await handler(request)

    return middleware


# ------------------------------------------------------------------ admin keys
#: The well-known default admin key of the agent proxy and gateway (AReaL's default).
DEFAULT_ADMIN_KEY = "areal-admin-key"

#: Environment variable with the admin key of a proxy (or gateway) started as a process.
PROXY_ADMIN_KEY_ENV = "AREAL_PROXY_ADMIN_KEY"


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ``::1``)."""
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False


def refuse_default_key_off_loopback(host: str, key: str | None, surface: str, how_to_set: str):
    """Raise ``ValueError`` when ``surface`` would bind ``host`` (not loopback) with the
    well-known default admin key; ``how_to_set`` says where a key is given."""
    if key is not None and keys_equal(key, DEFAULT_ADMIN_KEY) and not is_loopback_host(host):
        raise ValueError(
            f"{surface}: refusing to listen on {host} with the well-known default admin key "
            f"{DEFAULT_ADMIN_KEY!r} (anyone who can reach it could start sessions and export "
            f"trajectories). Set a secret admin key with {how_to_set}, or bind 127.0.0.1."
        )


def default_key_dir() -> str:
    """Where generated key files go: ``$XDG_RUNTIME_DIR/areal`` or ``~/.cache/areal``."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "areal")


def write_key_file(key: str, path: str) -> str:
    """Write ``key`` to ``path`` with mode 0600 (its directory 0700 when created)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)
    return path


def generate_admin_key_file(surface: str, path: str | None = None) -> tuple[str, str]:
    """A random admin key for ``surface`` (no key given), written to ``path`` (default
    ``default_key_dir()/<surface>-admin-key-<pid>``) readable by its user only; the path
    is logged, never the key. Returns ``(key, path)``."""
    key = new_key("sk-admin-")
    path = path or os.path.join(default_key_dir(), f"{surface}-admin-key-{os.getpid()}")
    write_key_file(key, path)
    logger.info(f"{surface}: no admin key given; generated one, stored in {path} (mode 0600)")
    return key, path
