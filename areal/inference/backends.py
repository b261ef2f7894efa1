"""The one registry of inference backends: backend name -> client engine, adapter, server command.

The inference part of an allocation (``local:d2``, ``vllm:d1``, ``sglang:d4t2``) names a
backend; everything that starts or talks to inference servers looks it up here::

    from areal.inference import backends as ib

    ib.available_backends()                     # ["local", "sglang", "vllm"]
    engine = ib.make_inference_engine("vllm", config.rollout)  # RemotevLLMEngine
    adapter = ib.make_adapter("sglang")         # SGLangBackend (protocol only)
    cmd, env = ib.server_command("vllm", config, tp_size=1)    # "{host}"/"{port}" placeholders

Each backend is a ``RemoteInfEngine`` subclass that owns its protocol adapter
(``engine.backend``) and two class methods: ``build_server_args(config, model_path,
tp_size, pp_size)`` (experiment config -> flag dict; vLLM/SGLang take every field of
``config.vllm`` / ``config.sglang``) and ``build_server_command(server_args)`` (flag dict
-> shell command + environment). ``register_inference_backend`` adds one.

``areal.infra`` never imports this module: the trainer looks the backend up and passes
the command (to ``areal.infra.scheduler.servers.launch_inference_servers``) and the engine
object (to ``RolloutController`` / ``WorkflowExecutor``) down.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

from areal.utils.dynamic_import import import_from_string


@dataclasses.dataclass(frozen=True)
class InferenceBackend:
    """One registry entry: ``engine`` is the import path of a ``RemoteInfEngine`` subclass."""

    name: str
    engine: str
    description: str = ""

    def engine_class(self) -> type:
        return import_from_string(self.engine)


_REGISTRY: dict[str, InferenceBackend] = {}


def register_inference_backend(name: str, engine: str, description: str = "") -> None:
    """Register (or replace) backend ``name`` served by the engine class at import path ``engine``."""
    if not name or ":" in name or "+" in name:
        raise ValueError(f"backend name {name!r} must be non-empty without ':' or '+'")
    _REGISTRY[name] = InferenceBackend(name, engine, description)


register_inference_backend(
    "local",
    "areal.inference.clients.local.RemoteLocalEngine",
    "built-in PyTorch server (python -m areal.inference.server)",
)
register_inference_backend(
    "vllm",
    "areal.inference.clients.vllm.RemotevLLMEngine",
    "vLLM OpenAI-compatible server in dev mode (AREAL_VLLM_PYTHON selects its interpreter)",
)
register_inference_backend(
    "sglang", "areal.inference.clients.sglang.RemoteSGLangEngine", "SGLang native server"
)


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_inference_backend(name: str) -> InferenceBackend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"inference backend {name!r}; allowed: {', '.join(available_backends())}"
        ) from None


def engine_class(name: str) -> type:
    """The ``RemoteInfEngine`` subclass that speaks backend ``name``."""
    return get_inference_backend(name).engine_class()


def make_inference_engine(name: str, config: Any = None) -> Any:
    """A client engine for backend ``name`` (``config``: an ``InferenceEngineConfig``)."""
    return engine_class(name)(config)


def make_adapter(name: str) -> Any:
    """The protocol adapter (``BackendAdapter``) of backend ``name``."""
    return make_inference_engine(name).backend


def build_server_args(
    name: str, config: Any, model_path: str | None = None, tp_size: int = 1, pp_size: int = 1
) -> dict[str, Any]:
    """Flag dict of one server of backend ``name`` from an experiment config."""
    return engine_class(name).build_server_args(
        config, model_path=model_path, tp_size=tp_size, pp_size=pp_size
    )


def server_command(
    name: str, config: Any, model_path: str | None = None, tp_size: int = 1, pp_size: int = 1
) -> tuple[str, dict[str, str]]:
    """Shell command (``{host}``/``{port}`` placeholders) and environment of one server."""
    cls = engine_class(name)
    args = cls.build_server_args(config, model_path=model_path, tp_size=tp_size, pp_size=pp_size)
    return cls.build_server_command(args)


def server_command_line(module: str, args: dict[str, Any], python: str = "python") -> str:
    """``python -m module --host {host} --port {port} --flag value ...`` as one shell string.

    The scheduler fills in ``{host}``/``{port}`` with ``str.format``: ``host``/``port`` in
    ``args`` give way to those placeholders and braces in the other values are escaped
    (:func:`escape_braces`). Flags follow ``get_py_cmd`` (``None``/``False`` left out)."""
    from areal.api.cli_args import get_py_cmd

    flags = {k: v for k, v in args.items() if k not in ("host", "port")}
    placeholders = {"host": "{host}", "port": "{port}"}
    return shlex.join(get_py_cmd(module, {**placeholders, **escape_braces(flags)}, python=python))


def escape_braces(args: dict[str, Any]) -> dict[str, Any]:
    """Double ``{``/``}`` in string values (and list items): schedulers ``str.format``
    every argument of a server command to fill in ``{host}``/``{port}``."""

    def esc(v: Any) -> Any:
        if isinstance(v, str):
            return v.replace("{", "{{").replace("}", "}}")
        if isinstance(v, list | tuple):
            return [esc(x) for x in v]
        return v

    return {k: esc(v) for k, v in args.items()}
