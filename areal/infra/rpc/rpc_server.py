"""RPC worker process: an HTTP server on 127.0.0.1 hosting engine objects.

Start: ``python -m areal.infra.rpc.rpc_server --port N [--host 127.0.0.1]``.

Endpoints (bodies are pickle bytes, see ``serialization``). Every endpoint except
``/health`` requires the run secret (``AREAL_RUN_SECRET`` in the worker's environment,
sent as ``Authorization: Bearer``; ``areal.utils.auth``): a request without it is answered
401 and logged before its body is read, so nothing is unpickled or executed. The worker
refuses to start without a secret unless ``--insecure-no-auth`` is given.

- ``GET /health`` -> JSON ``{"status": "ok", "pid", "engines", "busy"}``; answers
  even while a call runs.
- ``POST /create_engine`` ``{"engine": "pkg.mod.Class", "args", "kwargs",
  "engine_name"}`` imports the class and instantiates it.
- ``POST /call`` ``{"method", "args", "kwargs", "engine_name"}`` runs
  ``engine.method(*args, **kwargs)`` (or reads a non-callable attribute) and returns ``{"ok": True, "result": ...}``, or
  ``{"ok": False, "error_type", "error", "traceback"}`` with HTTP 500 when the engine
  (its method or constructor) raised. Successful calls also carry ``exec_s``, the
  seconds the engine method ran (the client's traffic counters subtract it from the
  call's wall time, ``areal.infra.rpc.traffic``).
  Batches held between calls: ``engine_name="__batch_store__"`` addresses the worker's
  ``BatchStore`` (put/update/fetch/apply/free/info), and ``StoredBatch`` handles among a
  call's arguments stand for the batches it holds (``areal.infra.rpc.batch_store``).
- ``POST /set_env`` JSON ``{"env": {...}}`` updates ``os.environ``.

Client errors never give a 5xx: a body that is not a pickled dict of the right shape
(``method``/``engine``/``engine_name`` strings, ``args`` a list or tuple, ``kwargs`` a dict
with string keys), arguments that do not fit the method's or class's signature, or an
invalid environment variable -> 400; an unknown engine, method or engine class -> 404.
The payload says ``"client_error": True`` and the Python exception it stands for
(``error_type``: ``TypeError``, ``AttributeError``, ``KeyError``, ...); ``RPCClient``
raises ``RemoteCallError`` as for any remote error.

Every engine construction and call runs on ONE dedicated thread, in arrival order:
``torch.distributed`` collectives need the same thread-affine order on all ranks, and
the controller calls all ranks concurrently. ``torch.set_num_threads`` defaults to 1
(``--num-threads`` / ``AREAL_WORKER_NUM_THREADS``).

The process exits by itself (code ``EXIT_PARENT_GONE``) when its parent (the controller)
dies, and exits at once on SIGTERM (engines hold no state worth a graceful shutdown;
checkpoints are explicit).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from areal.infra import stack_dump
from areal.infra.rpc.batch_store import STORE_ENGINE, BatchStore
from areal.infra.rpc.serialization import CONTENT_TYPE, deserialize, serialize
from areal.utils import auth, logging

logger = logging.getLogger("RPCServer")

MAX_BODY_BYTES = 64 * 1024**3

#: Exit code of a worker whose controller is gone (distinct from a crash, which exits 1).
EXIT_PARENT_GONE = 86
#: Exit code when started without a run secret (and without ``--insecure-no-auth``).
EXIT_NO_SECRET = 87

_FROM_ENV = object()


def import_from_path(path: str) -> Any:
    """Import ``pkg.mod.Name`` (or ``pkg.mod:Name``) and return the object."""
    if ":" in path:
        module_name, attr = path.split(":", 1)
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"Not an import path of a class: {path!r} (expected 'pkg.module.ClassName')"
        )
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class _BadRequest(ValueError):
    """The request is malformed (HTTP 400). ``error_type``: the Python exception it stands
    for (``TypeError`` for arguments that do not fit, ...)."""

    status = 400

    def __init__(self, msg: str, error_type: str = "TypeError"):
        super().__init__(msg)
        self.error_type = error_type


class _NotFound(_BadRequest):
    """The request names an engine, method or class that does not exist (HTTP 404)."""

    status = 404


def _check_arguments(fn: Any, args: Any, kwargs: Any, what: str) -> None:
    """Raise ``_BadRequest`` unless ``args``/``kwargs`` have the right types and fit ``fn``'s
    signature (when it has one)."""
    import inspect

    if not isinstance(args, list | tuple):
        raise _BadRequest(f"{what}: 'args' must be a list or tuple, got {type(args).__name__}")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise _BadRequest(f"{what}: 'kwargs' must be a dict with string keys")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: the call will tell
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise _BadRequest(f"{what}: arguments do not fit {what}{sig}: {e}") from None


def _name(payload: dict, key: str, default: str | None = None) -> str:
    value = payload.get(key, default)
    if not isinstance(value, str) or not value:
        raise _BadRequest(f"{key!r} must be a non-empty string, got {type(value).__name__!r}")
    return value


class EngineHost:
    """Holds the engines of one worker and runs their methods on a single thread."""

    def __init__(self):
        self.engines: dict[str, Any] = {}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.busy = 0
        self.store = BatchStore()

    def _create(self, payload: dict) -> dict:
        name = _name(payload, "engine_name", "default")
        path = _name(payload, "engine")
        args, kwargs = payload.get("args", ()), payload.get("kwargs", {})
        try:
            cls = import_from_path(path)
        except ValueError as e:
            raise _BadRequest(str(e), "ValueError") from None
        except (ImportError, AttributeError) as e:
            raise _NotFound(f"no engine class {path!r}: {e}", type(e).__name__) from None
        if not callable(cls):
            raise _BadRequest(f"{path!r} is not a class")
        _check_arguments(cls, args, kwargs, path)
        self.engines[name] = cls(*args, **kwargs)
        logger.info(f"Created engine {name!r}: {path}")
        return {"ok": True}

    def _call(self, payload: dict) -> dict:
        name = _name(payload, "engine_name", "default")
        method = _name(payload, "method")
        args, kwargs = payload.get("args", ()), payload.get("kwargs", {})
        if name == STORE_ENGINE:
            target = self.store
        elif name not in self.engines:
            raise _NotFound(
                f"No engine named {name!r} in this worker (create_engine first); have {sorted(self.engines)}",
                "KeyError",
            )
        else:
            target = self.engines[name]
        if method.startswith("_") and target is self.store:
            raise _NotFound(f"BatchStore has no public method {method!r}", "AttributeError")
        try:
            attr = getattr(target, method)
        except AttributeError as e:
            raise _NotFound(str(e), "AttributeError") from None
        if not callable(attr):  # a property/attribute such as ``data_parallel_rank``
            if args or kwargs:
                raise _BadRequest(
                    f"{method!r} is an attribute, not a method; it takes no arguments"
                )
            return {"ok": True, "result": attr}
        _check_arguments(attr, args, kwargs, method)
        handle = None
        if target is not self.store:
            args, kwargs, handle = self.store.resolve_args(args, kwargs)
        t0 = time.perf_counter()
        result = attr(*args, **kwargs)
        if handle is not None:
            result = self.store.keep_result(handle, result)
        return {"ok": True, "result": result, "exec_s": time.perf_counter() - t0}

    def run(self, kind: str, body: bytes) -> tuple[int, bytes]:
        """Runs on the engine thread: decode, execute, encode (errors become payloads)."""
        method = "?"
        try:
            payload = deserialize(body)
            if not isinstance(payload, dict) or (kind == "call" and "method" not in payload):
                raise _BadRequest(
                    f"{kind}: the body must be a pickled dict"
                    + (" with 'method'" if kind == "call" else " with 'engine'")
                )
            if kind == "create" and "engine" not in payload:
                raise _BadRequest("create: the body must be a pickled dict with 'engine'")
        except Exception as e:  # noqa: BLE001 - a malformed request is the client's error
            logger.warning(f"{kind}: bad request body: {type(e).__name__}: {e}")
            err = {
                "ok": False,
                "error_type": "BadRequest",
                "error": f"{type(e).__name__}: {e}",
                "client_error": True,
            }
            return 400, serialize(err)
        try:
            method = payload.get("method", "create_engine")
            out = self._create(payload) if kind == "create" else self._call(payload)
            return 200, serialize(out)
        except _BadRequest as e:  # the client's error (400/404): nothing ran
            logger.warning(f"{kind} {method}: client error {e.status}: {e.error_type}: {e}")
            err = {"ok": False, "error_type": e.error_type, "error": str(e), "client_error": True}
            return e.status, serialize(err)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            tb = traceback.format_exc()
            logger.error(f"{kind} {method} failed: {type(e).__name__}: {e}\n{tb}")
            err = {"ok": False, "error_type": type(e).__name__, "error": str(e), "traceback": tb}
            try:
                return 500, serialize(err)
            except Exception:  # noqa: BLE001
                err["error"] = repr(e)
                return 500, serialize(err)


def build_app(host: EngineHost, secret: Any = _FROM_ENV) -> web.Application:
    """The worker's aiohttp app; ``secret`` defaults to the run secret of the environment
    (``None``: no authentication, for in-process tests only)."""
    if secret is _FROM_ENV:
        secret = auth.get_run_secret()
    middleware = auth.aiohttp_middleware(
        lambda headers: auth.check_secret(headers, secret),
        protected=lambda path: path != "/health",
        surface="RPC worker",
    )
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[middleware])
    routes = web.RouteTableDef()

    @routes.get("/health")
    async def health(_request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "pid": os.getpid(),
                "engines": sorted(host.engines),
                "busy": host.busy > 0,
            }
        )

    async def _run(kind: str, request: web.Request) -> web.Response:
        body = await request.read()
        host.busy += 1
        try:
            loop = asyncio.get_running_loop()
            status, out = await loop.run_in_executor(host.executor, host.run, kind, body)
        finally:
            host.busy -= 1
        return web.Response(status=status, body=out, content_type=CONTENT_TYPE)

    @routes.post("/create_engine")
    async def create_engine(request: web.Request) -> web.Response:
        return await _run("create", request)

    @routes.post("/call")
    async def call(request: web.Request) -> web.Response:
        return await _run("call", request)

    @routes.post("/set_env")
    async def set_env(request: web.Request) -> web.Response:
        try:
            data = await request.json()
            if not isinstance(data, dict) or not isinstance(data.get("env"), dict):
                raise ValueError('expected {"env": {name: value}}')
        except ValueError as e:  # JSONDecodeError is a ValueError
            return web.json_response({"ok": False, "error": f"bad request: {e}"}, status=400)
        env = {str(k): str(v) for k, v in data["env"].items()}
        bad = [k for k, v in env.items() if not k or "=" in k or "\0" in k or "\0" in v]
        if bad:  # os.environ would raise on these
            return web.json_response(
                {"ok": False, "error": f"bad request: invalid environment variables {bad[:5]!r}"},
                status=400,
            )
        try:
            os.environ.update(env)
        except (ValueError, UnicodeError) as e:
            return web.json_response({"ok": False, "error": f"bad request: {e}"}, status=400)
        return web.json_response({"ok": True, "set": sorted(env)})

    app.add_routes(routes)
    return app


def _hard_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def _exit_if_parent_gone(parent_pid: int) -> None:
    if os.getppid() != parent_pid:
        logger.warning(f"Parent process {parent_pid} is gone; exiting")
        _hard_exit(EXIT_PARENT_GONE)


def _watch_parent(parent_pid: int, interval: float = 1.0) -> None:
    """Exit when the controller that started us is gone (we got re-parented)."""
    while True:
        time.sleep(interval)
        _exit_if_parent_gone(parent_pid)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="areal RPC worker hosting engine objects")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--num-threads", type=int, default=int(os.environ.get("AREAL_WORKER_NUM_THREADS", "1"))
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is no longer our parent (default: the current parent)",
    )
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help=f"serve without {auth.RUN_SECRET_ENV} (anyone reaching the port can run code)",
    )
    args = parser.parse_args(argv)
    secret = auth.get_run_secret()
    if secret is None and not args.insecure_no_auth:
        logger.error(
            f"{auth.RUN_SECRET_ENV} is not set: refusing to serve pickled calls without "
            "authentication (the controller's scheduler sets it; --insecure-no-auth overrides)"
        )
        _hard_exit(EXIT_NO_SECRET)

    import torch

    torch.set_num_threads(args.num_threads)
    signal.signal(signal.SIGTERM, lambda *_: _hard_exit(128 + signal.SIGTERM))
    stack_dump.install_process_handler("worker")  # the controller's hang dumps reach us
    parent = args.parent_pid if args.parent_pid is not None else os.getppid()
    if parent > 1:
        _exit_if_parent_gone(parent)  # already gone: exit before taking the port
        threading.Thread(
            target=_watch_parent, args=(parent,), daemon=True, name="parent-watch"
        ).start()

    host = EngineHost()
    logger.info(f"RPC worker pid {os.getpid()} serving on {args.host}:{args.port}")
    web.run_app(
        build_app(host, secret),
        host=args.host,
        port=args.port,
        print=None,
        handle_signals=False,
        access_log=None,
    )


if __name__ == "__main__":
    main()
