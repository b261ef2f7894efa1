"""areal.utils.auth: key extraction, key ring, and the aiohttp middleware on a real server."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from areal.utils import auth


def test_extract_key_bearer_and_x_api_key_found_other_schemes_ignored():
    assert auth.extract_key({"Authorization": "Bearer abc"}) == "abc"
    assert auth.extract_key({"authorization": "bearer  xyz "}) == "xyz"
    assert auth.extract_key({"x-api-key": "k1"}) == "k1"
    assert auth.extract_key({"Authorization": "Basic abc"}) is None
    assert auth.extract_key({"Authorization": "Bearer "}) is None
    assert auth.extract_key({}) is None


def test_keys_equal_empty_or_none_never_match():
    assert auth.keys_equal("a", "a")
    assert not auth.keys_equal("a", "b")
    assert not auth.keys_equal("", "")
    assert not auth.keys_equal(None, None)


def test_keyring_session_key_grants_session_not_admin_and_revocation_works():
    ring = auth.KeyRing(admin_key="adm")
    key = ring.issue("s1")
    assert key.startswith("sk-sess-") and len(key) > 40
    ok = ring.check(auth.auth_headers(key))
    assert ok.ok and ok.scope == auth.SESSION and ok.session_id == "s1"
    assert not ring.check(auth.auth_headers(key), need=auth.ADMIN).ok
    admin = ring.check(auth.auth_headers("adm"), need=auth.ADMIN)
    assert admin.ok and admin.scope == auth.ADMIN
    ring.revoke_session("s1")
    assert not ring.check(auth.auth_headers(key)).ok
    assert "revoked" in ring.check(auth.auth_headers(key)).reason


def test_check_secret_disabled_passes_enabled_needs_exact_secret():
    assert auth.check_secret({}, None).ok
    assert not auth.check_secret({}, "s").ok
    assert not auth.check_secret(auth.auth_headers("t"), "s").ok
    assert auth.check_secret(auth.auth_headers("s"), "s").ok


def test_ensure_run_secret_creates_once_and_exports(monkeypatch):
    monkeypatch.delenv(auth.RUN_SECRET_ENV, raising=False)
    s = auth.ensure_run_secret()
    assert auth.get_run_secret() == s
    assert auth.ensure_run_secret() == s


async def test_aiohttp_middleware_401_before_handler_runs():
    calls: list[str] = []

    async def handler(request):
        calls.append(request.path)
        return web.json_response({"ok": True})

    app = web.Application(
        middlewares=[
            auth.aiohttp_middleware(
                lambda h: auth.check_secret(h, "secret"), protected={"/ctl"}, surface="test"
            )
        ]
    )
    app.router.add_post("/ctl", handler)
    app.router.add_get("/health", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{base}/ctl", data=b"\x80\x04junk") as r:
                assert r.status == 401
                assert "unauthorized" in (await r.json())["error"]["message"]
            async with s.post(f"{base}/ctl", headers=auth.auth_headers("nope")) as r:
                assert r.status == 401
            assert calls == []
            async with s.post(f"{base}/ctl", headers=auth.auth_headers("secret")) as r:
                assert r.status == 200
            async with s.get(f"{base}/health") as r:
                assert r.status == 200
        assert calls == ["/ctl", "/health"]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("need", [auth.ADMIN, auth.SESSION])
def test_keyring_missing_key_reason_names_headers(need):
    r = auth.KeyRing().check({}, need=need)
    assert not r.ok and "Authorization" in r.reason
