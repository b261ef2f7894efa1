"""A ``spawn`` multiprocessing context whose children do not re-import the parent's script.

CPython's ``spawn`` start method imports the parent's ``__main__`` module (the training
script, as ``__mp_main__``) in every child, so that objects defined there can be
unpickled. A reward worker that runs ``areal.reward.gsm8k.gsm8k_reward_fn`` then imports
the script's torch, transformers and trainer for nothing: about 4-6 CPU-seconds and a few
hundred MB per worker. ``no_main_spawn_context()`` returns a context whose processes skip
that import. Use it only for work that :func:`refers_to_main` says needs nothing from
``__main__``.

What happens when such a process starts:

1. Its ``Popen`` marks the current thread, then runs the standard spawn launch.
2. The launch asks ``multiprocessing.spawn.get_preparation_data`` what the child must set
   up. A wrapper around that function (installed once, on the first use) drops the
   ``init_main_from_path`` / ``init_main_from_name`` entries, for a marked thread only:
   every other spawn, from any thread, is unchanged.
3. The child starts from multiprocessing's own bootstrap and imports only the modules of
   what it unpickles.

POSIX only (the ``spawn`` Popen of Linux and macOS); elsewhere the plain ``spawn``
context is returned.
"""

from __future__ import annotations

import multiprocessing
import pickle
import sys
import threading
from multiprocessing import context as mp_context
from multiprocessing import spawn

_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")
_marked = threading.local()
_install_lock = threading.Lock()
_installed = False


def refers_to_main(obj: object) -> bool:
    """Whether pickling ``obj`` names the ``__main__`` module (a function or class of the
    script), so a child must import the script to unpickle it. Unpicklable: True."""
    try:
        return b"__main__" in pickle.dumps(obj)
    except Exception:
        return True


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        original = spawn.get_preparation_data

        def get_preparation_data(name):
            data = original(name)
            if getattr(_marked, "skip_main", False):
                for key in _MAIN_KEYS:
                    data.pop(key, None)
            return data

        spawn.get_preparation_data = get_preparation_data
        _installed = True


if sys.platform != "win32":
    from multiprocessing import popen_spawn_posix

    class _NoMainPopen(popen_spawn_posix.Popen):
        def _launch(self, process_obj):
            _marked.skip_main = True
            try:
                super()._launch(process_obj)
            finally:
                _marked.skip_main = False

    class _NoMainProcess(mp_context.SpawnProcess):
        @staticmethod
        def _Popen(process_obj):
            return _NoMainPopen(process_obj)

    class _NoMainSpawnContext(mp_context.SpawnContext):
        Process = _NoMainProcess


def no_main_spawn_context() -> multiprocessing.context.BaseContext:
    """A ``spawn`` context whose children do not import the parent's ``__main__``."""
    if sys.platform == "win32":  # pragma: no cover - not a supported platform for training
        return multiprocessing.get_context("spawn")
    _install()
    return _NoMainSpawnContext()
