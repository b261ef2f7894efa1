"""Key-value registry (AReaL's ``name_resolve``) with a file-system backend.

Keys are ``/``-separated names (``{experiment}/{trial}/workers/actor/0``); each value
is one file under the root directory, written atomically (temp file + ``os.replace``)
so readers on any process that shares the file system never see a partial value.

The module-level functions use a default repository rooted at
``$AREAL_NAME_RESOLVE_ROOT`` or ``{tempdir}/areal/name_resolve``; call
``reconfigure(root)`` (e.g. ``{cluster.fileroot}/name_resolve``) to move it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time


class NameEntryExistsError(KeyError):
    pass


class NameEntryNotFoundError(KeyError):
    pass


def _check_name(name: str) -> str:
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
        return os.path.join(self.root, _check_name(name), self.VALUE_FILE)

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
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def get(self, name: str) -> str:
        try:
            with open(self._path(name)) as f:
                return f.read()
        except FileNotFoundError:
            raise NameEntryNotFoundError(name) from None

    def wait(self, name: str, timeout: float | None = None, poll_frequency: float = 0.1) -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.get(name)
            except NameEntryNotFoundError:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"name_resolve key {name!r} did not appear within {timeout} s"
                    ) from None
                time.sleep(poll_frequency)

    def delete(self, name: str) -> None:
        path = self._path(name)
        if not os.path.exists(path):
            raise NameEntryNotFoundError(name)
        os.unlink(path)

    def get_subtree(self, name_root: str) -> list[str]:
        """Values of every key under ``name_root``, sorted by key."""
        return [self.get(k) for k in self.find_subtree(name_root)]

    def find_subtree(self, name_root: str) -> list[str]:
        base = os.path.join(self.root, _check_name(name_root))
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            if self.VALUE_FILE in files:
                keys.append(os.path.relpath(dirpath, self.root).replace(os.sep, "/"))
        return sorted(keys)

    def clear_subtree(self, name_root: str) -> None:
        shutil.rmtree(os.path.join(self.root, _check_name(name_root)), ignore_errors=True)

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
    """

    def __init__(
        self, actor_name: str = "ray_kv_store", namespace: str = "areal", timeout: float = 60.0
    ):
        import ray

        self.actor_name = actor_name
        self.namespace = namespace
        self.timeout = timeout
        self._actor = (
            ray.remote(_RayKVStore)
            .options(
                name=actor_name,
                namespace=namespace,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
            )
            .remote()
        )

    def _get(self, ref):
        import ray

        return ray.get(ref, timeout=self.timeout)

    def add(self, name: str, value: str, replace: bool = False, **_ignored) -> None:
        name = _check_name(name)
        if not self._get(self._actor.add.remote(name, str(value), replace)):
            raise NameEntryExistsError(name)

    def get(self, name: str) -> str:
        name = _check_name(name)
        value = self._get(self._actor.get.remote(name))
        if value is None:
            raise NameEntryNotFoundError(name)
        return value

    def wait(self, name: str, timeout: float | None = None, poll_frequency: float = 0.1) -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.get(name)
            except NameEntryNotFoundError:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"name_resolve key {name!r} did not appear within {timeout} s"
                    ) from None
                time.sleep(poll_frequency)

    def delete(self, name: str) -> None:
        name = _check_name(name)
        if not self._get(self._actor.delete.remote(name)):
            raise NameEntryNotFoundError(name)

    def find_subtree(self, name_root: str) -> list[str]:
        return self._get(self._actor.keys.remote(_check_name(name_root)))

    def get_subtree(self, name_root: str) -> list[str]:
        return [self.get(k) for k in self.find_subtree(name_root)]

    def clear_subtree(self, name_root: str) -> None:
        self._get(self._actor.clear.remote(_check_name(name_root)))

    def reset(self) -> None:
        self._get(self._actor.clear.remote(None))

    def destroy(self) -> None:
        """Kill the store actor (all entries are lost)."""
        import ray

        ray.kill(self._actor, no_restart=True)


def make_repository(config) -> FileNameRecordRepository | RayNameRecordRepository:
    """Repository for a ``NameResolveConfig`` (``nfs`` or ``ray``; etcd3 is not implemented)."""
    if config.type == "nfs":
        return FileNameRecordRepository(config.nfs_record_root)
    if config.type == "ray":
        return RayNameRecordRepository(config.ray_actor_name)
    raise NotImplementedError(f"name_resolve.type={config.type!r}; implemented: 'nfs', 'ray'")
