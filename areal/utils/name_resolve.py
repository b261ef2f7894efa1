"""Key-value registry (AReaL's ``name_resolve``): file-system, etcd3 and Ray backends.

Keys are ``/``-separated names (``{experiment}/{trial}/workers/actor/0``); each value
is one file under the root directory, written atomically (temp file + ``os.replace``)
so readers on any process that shares the file system never see a partial value.

The module-level functions use a default repository rooted at
``$AREAL_NAME_RESOLVE_ROOT`` or ``{tempdir}/areal/name_resolve``; call
``reconfigure(root)`` (e.g. ``{cluster.fileroot}/name_resolve``) to move it.

``Etcd3NameRecordRepository`` (``name_resolve.type: etcd3``, ``etcd3_addr``) speaks etcd's
v3 HTTP/JSON gateway (``/v3/kv/*``, ``/v3/lease/*``) with ``requests``: no gRPC client
needed. ``RayNameRecordRepository`` keeps the values in a named Ray actor.
"""

from __future__ import annotations

import atexit
import base64
import os
import shutil
import tempfile
import threading
import time

from areal.utils import logging

logger = logging.getLogger("NameResolve")


class NameEntryExistsError(KeyError):
    pass


class NameEntryNotFoundError(KeyError):
    pass


def wait_for_key(
    get, name: str, timeout: float | None, poll_frequency: float, where: str = ""
) -> str:
    """Poll ``get(name)`` until the key exists (every backend's ``wait``); ``TimeoutError``
    naming the key (and ``where``) after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return get(name)
        except NameEntryNotFoundError:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"name_resolve key {name!r} did not appear within {timeout} s{where}"
                ) from None
            time.sleep(poll_frequency)


def check_name(name: str) -> str:
    name = name.strip("/")
    if not name or any(p in ("", ".", "..") for p in name.split("/")):
        raise ValueError(f"Invalid name_resolve key {name!r}")
    return name


class FileNameRecordRepository:
    """One file per key under ``root``; safe across processes on one file system."""

    VALUE_FILE = "ENTRY"

    def __init__(self, root: str):
        self.root = os.path.abspath(root)

    def _path(self, name: str) -> str:
        return os.path.join(self.root, check_name(name), self.VALUE_FILE)

    def add(self, name: str, value: str, replace: bool = False, **_ignored) -> None:
        """Store ``value``; raises ``NameEntryExistsError`` unless ``replace``. (``keepalive_ttl`` is accepted and ignored.)"""
        path = self._path(name)
        if os.path.exists(path) and not replace:
            raise NameEntryExistsError(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(str(value))
            if replace:
                os.replace(tmp, path)
            else:
                # link() fails if the name exists: of two racing writers, exactly one wins.
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise NameEntryExistsError(name) from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def get(self, name: str) -> str:
        try:
            with open(self._path(name)) as f:
                return f.read()
        except FileNotFoundError:
            raise NameEntryNotFoundError(name) from None

    def wait(self, name: str, timeout: float | None = None, poll_frequency: float = 0.1) -> str:
        return wait_for_key(self.get, name, timeout, poll_frequency)

    def delete(self, name: str) -> None:
        path = self._path(name)
        if not os.path.exists(path):
            raise NameEntryNotFoundError(name)
        os.unlink(path)

    def get_subtree(self, name_root: str) -> list[str]:
        """Values of every key under ``name_root``, sorted by key."""
        return [self.get(k) for k in self.find_subtree(name_root)]

    def find_subtree(self, name_root: str) -> list[str]:
        base = os.path.join(self.root, check_name(name_root))
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            if self.VALUE_FILE in files:
                keys.append(os.path.relpath(dirpath, self.root).replace(os.sep, "/"))
        return sorted(keys)

    def clear_subtree(self, name_root: str) -> None:
        shutil.rmtree(os.path.join(self.root, check_name(name_root)), ignore_errors=True)

    def reset(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


_default = FileNameRecordRepository(
    os.environ.get(
        "AREAL_NAME_RESOLVE_ROOT", os.path.join(tempfile.gettempdir(), "areal", "name_resolve")
    )
)


def reconfigure(root: str) -> FileNameRecordRepository:
    global _default
    _default = FileNameRecordRepository(root)
    return _default


def add(name: str, value: str, replace: bool = False, **kwargs) -> None:
    _default.add(name, value, replace=replace, **kwargs)


def get(name: str) -> str:
    return _default.get(name)


def wait(name: str, timeout: float | None = None, poll_frequency: float = 0.1) -> str:
    return _default.wait(name, timeout=timeout, poll_frequency=poll_frequency)


def delete(name: str) -> None:
    _default.delete(name)


def get_subtree(name_root: str) -> list[str]:
    return _default.get_subtree(name_root)


def find_subtree(name_root: str) -> list[str]:
    return _default.find_subtree(name_root)


def clear_subtree(name_root: str) -> None:
    _default.clear_subtree(name_root)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


class Etcd3NameRecordRepository:
    """Same interface, values held by an etcd v3 server, through its HTTP/JSON gateway.

    ``addr`` is ``host:port`` (or ``http://host:port``) of the server's client URL. Keys
    are stored as given (``e/t/workers/actor/0``); a subtree is one range request
    (``[root, root + "0")``, filtered to ``root`` and ``root/...``). ``add`` without
    ``replace`` is one transaction (put if the key was never created), so two processes
    racing for a key cannot both win. ``add(..., keepalive_ttl=S)`` binds the key to a
    lease of ``S`` seconds that a daemon thread of this process refreshes every ``S/3``:
    when the owner dies (or its node is cut off) the key disappears within ``S``.
    ``close()`` (also run at exit) stops the refresh, revokes the leases and deletes the
    keys added with ``delete_on_exit=True``.
    """

    def __init__(self, addr: str = "localhost:2379", timeout: float = 10.0):
        import requests

        if not addr or ":" not in addr.removeprefix("http://"):
            raise ValueError(
                f"NameResolveConfig.etcd3_addr={addr!r}: expected host:port (e.g. 10.0.0.1:2379)"
            )
        self.addr = addr
        self.url = addr if addr.startswith(("http://", "https://")) else f"http://{addr}"
        self.timeout = timeout
        self._session = requests.Session()
        self._lock = threading.Lock()
        self._leases: dict[int, float] = {}  # lease id -> ttl, refreshed by the thread
        self._key_lease: dict[str, int] = {}  # keys we own with a lease
        self._to_delete: set[str] = set()  # keys deleted by close()
        self._stop = threading.Event()
        self._keepalive_thread: threading.Thread | None = None
        self.keepalive_failures = 0  # refreshes that failed (logged each time)
        atexit.register(self.close)

    # --- HTTP ---
    def _post(self, path: str, body: dict, session=None) -> dict:
        import requests

        try:
            r = (session or self._session).post(self.url + path, json=body, timeout=self.timeout)
        except requests.RequestException as e:
            raise ConnectionError(
                f"etcd3 name_resolve: {path} to {self.addr} failed: {type(e).__name__}: {e}"
            ) from e
        if r.status_code != 200:
            raise RuntimeError(
                f"etcd3 name_resolve: {path} to {self.addr} answered {r.status_code}: {r.text[:300]}"
            )
        return r.json()

    def _range(self, root: str, keys_only: bool) -> list[tuple[str, str]]:
        body = {"key": _b64(root), "range_end": _b64(root + "0"), "keys_only": keys_only}
        kvs = self._post("/v3/kv/range", body).get("kvs", [])
        out = []
        for kv in kvs:
            key = _unb64(kv["key"])
            if key == root or key.startswith(root + "/"):
                out.append((key, "" if keys_only else _unb64(kv.get("value", ""))))
        return sorted(out)

    # --- leases ---
    def _grant(self, ttl: float) -> int:
        lease = int(self._post("/v3/lease/grant", {"TTL": max(1, int(ttl))})["ID"])
        with self._lock:
            self._leases[lease] = ttl
            if self._keepalive_thread is None:
                self._keepalive_thread = threading.Thread(
                    target=self._keepalive_loop, name="etcd3-keepalive", daemon=True
                )
                self._keepalive_thread.start()
        return lease

    def _revoke(self, lease: int) -> None:
        with self._lock:
            self._leases.pop(lease, None)
        try:
            self._post("/v3/lease/revoke", {"ID": str(lease)})
        except (ConnectionError, RuntimeError) as e:
            logger.warning(f"etcd3 lease {lease} not revoked (expires by itself): {e}")

    def _keepalive_loop(self) -> None:
        import requests

        session = requests.Session()
        while True:
            with self._lock:
                leases = dict(self._leases)
            interval = max(0.2, min(leases.values(), default=3.0) / 3)
            if self._stop.wait(interval):
                return
            for lease, ttl in leases.items():
                try:
                    res = self._post("/v3/lease/keepalive", {"ID": str(lease)}, session=session)
                    alive = int(res.get("result", {}).get("TTL", 0)) > 0
                except (ConnectionError, RuntimeError) as e:
                    self.keepalive_failures += 1
                    logger.warning(f"etcd3 lease {lease} (ttl {ttl} s) not refreshed: {e}")
                    continue
                if not alive:
                    self.keepalive_failures += 1
                    with self._lock:
                        self._leases.pop(lease, None)
                        lost = [k for k, v in self._key_lease.items() if v == lease]
                    logger.warning(f"etcd3 lease {lease} expired; keys gone: {lost}")

    # --- the repository interface ---
    def add(
        self,
        name: str,
        value: str,
        replace: bool = False,
        keepalive_ttl: float | None = None,
        delete_on_exit: bool = True,
        **_ignored,
    ) -> None:
        """Store ``value``; raises ``NameEntryExistsError`` unless ``replace``."""
        name = check_name(name)
        if keepalive_ttl is not None and keepalive_ttl <= 0:
            raise ValueError(f"keepalive_ttl={keepalive_ttl!r}: must be > 0 seconds or None")
        lease = self._grant(keepalive_ttl) if keepalive_ttl else None
        put = {"key": _b64(name), "value": _b64(str(value))}
        if lease is not None:
            put["lease"] = str(lease)
        if replace:
            self._post("/v3/kv/put", put)
        else:
            txn = {
                "compare": [
                    {
                        "key": _b64(name),
                        "target": "CREATE",
                        "result": "EQUAL",
                        "create_revision": "0",
                    }
                ],
                "success": [{"request_put": put}],
            }
            if not self._post("/v3/kv/txn", txn).get("succeeded", False):
                if lease is not None:
                    self._revoke(lease)
                raise NameEntryExistsError(name)
        with self._lock:
            old = self._key_lease.pop(name, None)
            if lease is not None:
                self._key_lease[name] = lease
            if delete_on_exit:
                self._to_delete.add(name)
        if old is not None and old != lease:
            self._revoke(old)

    def get(self, name: str) -> str:
        name = check_name(name)
        kvs = self._post("/v3/kv/range", {"key": _b64(name)}).get("kvs", [])
        if not kvs:
            raise NameEntryNotFoundError(name)
        return _unb64(kvs[0].get("value", ""))

    def wait(self, name: str, timeout: float | None = None, poll_frequency: float = 0.1) -> str:
        return wait_for_key(self.get, name, timeout, poll_frequency, f" (etcd3 at {self.addr})")

    def delete(self, name: str) -> None:
        name = check_name(name)
        res = self._post("/v3/kv/deleterange", {"key": _b64(name)})
        with self._lock:
            lease = self._key_lease.pop(name, None)
            self._to_delete.discard(name)
        if lease is not None:
            self._revoke(lease)
        if int(res.get("deleted", 0)) == 0:
            raise NameEntryNotFoundError(name)

    def find_subtree(self, name_root: str) -> list[str]:
        return [k for k, _ in self._range(check_name(name_root), keys_only=True)]

    def get_subtree(self, name_root: str) -> list[str]:
        """Values of every key under ``name_root``, sorted by key (one range request)."""
        return [v for _, v in self._range(check_name(name_root), keys_only=False)]

    def clear_subtree(self, name_root: str) -> None:
        root = check_name(name_root)
        self._post("/v3/kv/deleterange", {"key": _b64(root + "/"), "range_end": _b64(root + "0")})
        self._post("/v3/kv/deleterange", {"key": _b64(root)})
        with self._lock:
            for k in [k for k in self._to_delete if k == root or k.startswith(root + "/")]:
                self._to_delete.discard(k)

    def reset(self) -> None:
        """Delete the keys this repository added (``delete_on_exit``) and revoke its leases."""
        with self._lock:
            keys, self._to_delete = sorted(self._to_delete), set()
            leases, self._leases = list(self._leases), {}
            self._key_lease.clear()
        for key in keys:
            try:
                self._post("/v3/kv/deleterange", {"key": _b64(key)})
            except (ConnectionError, RuntimeError) as e:
                logger.warning(f"etcd3 key {key!r} not deleted at reset: {e}")
        for lease in leases:
            self._revoke(lease)

    def close(self) -> None:
        """Stop refreshing leases, then ``reset()``; safe to call twice."""
        self._stop.set()
        thread = self._keepalive_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.timeout)
        if self._to_delete or self._leases:
            self.reset()
        atexit.unregister(self.close)


class _RayKVStore:
    """Body of the named detached Ray actor behind ``RayNameRecordRepository``."""

    def __init__(self):
        self.data: dict[str, str] = {}

    def add(self, name: str, value: str, replace: bool) -> bool:
        if name in self.data and not replace:
            return False
        self.data[name] = value
        return True

    def get(self, name: str) -> str | None:
        return self.data.get(name)

    def delete(self, name: str) -> bool:
        return self.data.pop(name, None) is not None

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.data if k == prefix or k.startswith(prefix + "/"))

    def clear(self, prefix: str | None) -> None:
        if prefix is None:
            self.data.clear()
        else:
            for k in self.keys(prefix):
                del self.data[k]


class RayNameRecordRepository:
    """Same interface, values held by a named detached Ray actor (``ray_actor_name``).

    Needs a connected Ray (``ray.init``); the actor is created on first use
    (``get_if_exists``) in ``namespace`` and lives until ``destroy()`` or the cluster ends.
    It is pinned to the node of the process that creates it (the controller's): left to
    Ray it could land on an inference node, and losing that node would lose every name.
    """

    def __init__(
        self, actor_name: str = "ray_kv_store", namespace: str = "areal", timeout: float = 60.0
    ):
        import ray

        self.actor_name = actor_name
        self.namespace = namespace
        self.timeout = timeout
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._actor = (
            ray.remote(_RayKVStore)
            .options(
                name=actor_name,
                namespace=namespace,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
                scheduling_strategy=here,
            )
            .remote()
        )

    def _get(self, ref):
        import ray

        return ray.get(ref, timeout=self.timeout)

    def add(self, name: str, value: str, replace: bool = False, **_ignored) -> None:
        name = check_name(name)
        if not self._get(self._actor.add.remote(name, str(value), replace)):
            raise NameEntryExistsError(name)

    def get(self, name: str) -> str:
        name = check_name(name)
        value = self._get(self._actor.get.remote(name))
        if value is None:
            raise NameEntryNotFoundError(name)
        return value

    def wait(self, name: str, timeout: float | None = None, poll_frequency: float = 0.1) -> str:
        return wait_for_key(self.get, name, timeout, poll_frequency)

    def delete(self, name: str) -> None:
        name = check_name(name)
        if not self._get(self._actor.delete.remote(name)):
            raise NameEntryNotFoundError(name)

    def find_subtree(self, name_root: str) -> list[str]:
        return self._get(self._actor.keys.remote(check_name(name_root)))

    def get_subtree(self, name_root: str) -> list[str]:
        return [self.get(k) for k in self.find_subtree(name_root)]

    def clear_subtree(self, name_root: str) -> None:
        self._get(self._actor.clear.remote(check_name(name_root)))

    def reset(self) -> None:
        self._get(self._actor.clear.remote(None))

    def destroy(self) -> None:
        """Kill the store actor (all entries are lost)."""
        import ray

        ray.kill(self._actor, no_restart=True)


def make_repository(
    config,
) -> FileNameRecordRepository | Etcd3NameRecordRepository | RayNameRecordRepository:
    """Repository for a ``NameResolveConfig`` (``nfs``, ``etcd3`` or ``ray``)."""
    if config.type == "nfs":
        return FileNameRecordRepository(config.nfs_record_root)
    if config.type == "etcd3":
        return Etcd3NameRecordRepository(config.etcd3_addr)
    if config.type == "ray":
        return RayNameRecordRepository(config.ray_actor_name)
    raise ValueError(f"name_resolve.type={config.type!r}; allowed: 'nfs', 'etcd3', 'ray'")
