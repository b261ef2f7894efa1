"""Reasoning Gym task specs: ``reasoning_gym://<task>?size=N&seed=S&<task options>``.

Parsing a path (typed options, clear errors), the seeds of its splits and the Reasoning
Gym ``ProceduralDataset`` it names, shared by the dataset loader
(:mod:`areal.dataset.reasoning_gym`, whose docstring describes the path) and the reward
(:mod:`areal.reward.reasoning_gym`, which rebuilds a row's entry).
"""

from __future__ import annotations

import dataclasses
import typing
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

from areal.utils import logging

logger = logging.getLogger("ReasoningGym")

RG_SCHEME = "reasoning_gym://"
DEFAULT_SIZE = 1000
# seeds of the splits other than "train" lie this far (times 1..1000) from the train seed
SPLIT_SEED_STRIDE = 10_000_000
_RESERVED = ("size", "seed")


@dataclass(frozen=True)
class RGSpec:
    """A parsed ``reasoning_gym://`` path: tasks with weights, options per task, size, seed."""

    tasks: tuple[tuple[str, float], ...]
    options: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
    size: int = DEFAULT_SIZE
    seed: int = 0

    def task_options(self, task: str) -> dict[str, Any]:
        return dict(dict(self.options).get(task, ()))

    def with_seed(self, seed: int) -> RGSpec:
        return dataclasses.replace(self, seed=seed)

    def to_path(self) -> str:
        """The canonical path of this spec (parses back to an equal spec)."""
        mix = len(self.tasks) > 1
        head = ",".join(f"{t}:{_fmt(w)}" if mix else t for t, w in self.tasks)
        query = [f"size={self.size}", f"seed={self.seed}"]
        for task, opts in self.options:
            for key, value in opts:
                query.append(f"{task + '.' if mix else ''}{key}={_fmt(value)}")
        return f"{RG_SCHEME}{head}?{'&'.join(query)}"


def _fmt(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(_fmt(v) for v in value)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).replace("%", "%25").replace(",", "%2C").replace("&", "%26")


def is_reasoning_gym_path(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(RG_SCHEME)


def _registry() -> dict[str, tuple[type, type]]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ImportError(
            "reasoning_gym:// datasets need the reasoning-gym package: "
            "pip install 'areal[envs]' (make setup installs it)"
        ) from e
    return DATASETS


def available_tasks() -> list[str]:
    """Every Reasoning Gym task name (``composite`` is the mix, written ``a:w,b:w``)."""
    return sorted(n for n in _registry() if n != "composite")


def _config_fields(task: str) -> dict[str, tuple[Any, Any]]:
    """``{field: (type annotation, default)}`` of the task's config dataclass."""
    _, config_cls = _registry()[task]
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # forward references a task module cannot resolve
        hints = {}
    out = {}
    for f in dataclasses.fields(config_cls):
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out[f.name] = (hints.get(f.name, f.type), default)
    return out


def _split_values(raw: str) -> list[str]:
    return [unquote(p).strip() for p in raw.split(",") if p.strip()]


def _scalar(raw: str, kind: Any, where: str) -> Any:
    low = raw.lower()
    if low in ("none", "null"):
        return None
    if kind is bool:
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ValueError(f"{where}={raw!r} must be a boolean (true/false)")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{where}={raw!r} must be an integer") from None
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{where}={raw!r} must be a number") from None
    return unquote(raw)


def _base_kind(annotation: Any, default: Any) -> tuple[Any, Any]:
    """``(container, element kind)`` of a field: container ``list``/``tuple``/``None``."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        return _base_kind(args[0], default)
    if origin in (list, tuple) or isinstance(default, list | tuple):
        elem = args[0] if args else None
        if elem is None and default:
            elem = type(next(iter(default)))
        return (tuple if origin is tuple or isinstance(default, tuple) else list), elem
    if origin is typing.Literal:
        return None, type(args[0]) if args else str
    if annotation in (bool, int, float, str):
        return None, annotation
    if default is not None and type(default) in (bool, int, float, str):
        return None, type(default)
    return None, str


def _convert(task: str, key: str, raw: str, path: str) -> Any:
    fields = _config_fields(task)
    if key not in fields or key in _RESERVED:
        allowed = sorted(k for k in fields if k not in _RESERVED)
        raise ValueError(
            f"unknown option {key!r} for Reasoning Gym task {task!r} in {path!r}; "
            f"its options: {allowed}"
        )
    annotation, default = fields[key]
    container, kind = _base_kind(annotation, default)
    where = f"{path}: {task}.{key}"
    if container is None:
        return _scalar(raw, kind, where)
    if raw.lower() in ("none", "null"):
        return None
    return container(_scalar(v, kind, where) for v in _split_values(raw))


def _parse_query(query: str) -> list[tuple[str, str]]:
    # not urllib's parse_qsl: it reads '+' as a space, and '+' is an operator here
    out = []
    for part in query.split("&"):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"query part {part!r} has no '=' (write key=value)")
        out.append((unquote(key).strip(), value.strip()))
    return out


@lru_cache(maxsize=64)
def parse_reasoning_gym_path(path: str) -> RGSpec:
    """``reasoning_gym://task?size=..&seed=..&opt=..`` -> :class:`RGSpec` (clear errors)."""
    if not is_reasoning_gym_path(path):
        raise ValueError(f"not a Reasoning Gym path: {path!r} (expected '{RG_SCHEME}<task>?...')")
    head, _, query = path[len(RG_SCHEME) :].partition("?")
    head = head.strip("/")
    if not head:
        raise ValueError(f"{path!r} names no task; tasks: {available_tasks()}")
    tasks: list[tuple[str, float]] = []
    for item in head.split(","):
        name, sep, weight = item.strip().partition(":")
        name = name.strip()
        if name not in available_tasks():
            raise ValueError(
                f"unknown Reasoning Gym task {name!r} in {path!r}; available tasks: "
                f"{available_tasks()}"
            )
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(
                f"weight {weight!r} of task {name!r} in {path!r} is not a number"
            ) from None
        if not w > 0:
            raise ValueError(f"weight {weight!r} of task {name!r} in {path!r} must be > 0")
        if name in dict(tasks):
            raise ValueError(f"task {name!r} appears twice in {path!r}")
        tasks.append((name, w))
    mix = len(tasks) > 1
    size, seed = DEFAULT_SIZE, 0
    options: dict[str, dict[str, Any]] = {t: {} for t, _ in tasks}
    for key, raw in _parse_query(query):
        if key in _RESERVED:
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"{key}={raw!r} in {path!r} must be an integer") from None
            if key == "size":
                if value < 1:
                    raise ValueError(f"size={value} in {path!r} must be >= 1")
                size = value
            else:
                seed = value
            continue
        task, dot, field = key.partition(".")
        if not dot:
            if mix:
                raise ValueError(
                    f"option {key!r} in the mix {path!r} names no task: write "
                    f"'<task>.{key}=...' with a task of {[t for t, _ in tasks]}"
                )
            task, field = tasks[0][0], key
        elif task not in options:
            raise ValueError(
                f"option {key!r} in {path!r} names task {task!r}, which is not in "
                f"{[t for t, _ in tasks]}"
            )
        options[task][field] = _convert(task, field, raw, path)
    spec = RGSpec(
        tasks=tuple(tasks),
        options=tuple((t, tuple(sorted(o.items()))) for t, o in options.items() if o),
        size=size,
        seed=seed,
    )
    build_rg_dataset(spec)  # the task's own validation (assertions) as a ValueError
    return spec


def split_seed(seed: int, split: str) -> int:
    """The seed of ``split``: ``seed`` for ``train``, else 10^7 x (1..1000) away from it."""
    if split == "train":
        return seed
    return seed + SPLIT_SEED_STRIDE * (1 + zlib.crc32(split.encode()) % 1000)


@lru_cache(maxsize=16)
def build_rg_dataset(spec: RGSpec) -> Any:
    """The Reasoning Gym ``ProceduralDataset`` of ``spec`` (``composite`` for a mix)."""
    import reasoning_gym

    try:
        if len(spec.tasks) == 1:
            task = spec.tasks[0][0]
            return reasoning_gym.create_dataset(
                task, size=spec.size, seed=spec.seed, **spec.task_options(task)
            )
        from reasoning_gym.composite import DatasetSpec

        return reasoning_gym.create_dataset(
            "composite",
            size=spec.size,
            seed=spec.seed,
            datasets=[
                DatasetSpec(name=t, weight=w, config=spec.task_options(t)) for t, w in spec.tasks
            ],
        )
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"Reasoning Gym rejected {spec.to_path()!r}: {e}") from e
