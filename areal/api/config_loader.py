"""Loading: ``load_expr_config`` (YAML + command-line overrides -> typed config), ``build_config``, ``save_config``.

Re-exported by ``areal.api.cli_args``; import from there or from here.
"""

from __future__ import annotations

import copy
import difflib
import os
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf import errors as oc_errors

from areal.api.config_common import ConfigT, conf_as_dict, logger, warn_once
from areal.api.experiment_config import apply_cpu_fallbacks, warn_not_acted_on

_SUBSECTION_DEFAULTS = {
    "experiment_name": "${experiment_name}",
    "trial_name": "${trial_name}",
    "fileroot": "${cluster.fileroot}",
}


def _unwrap_optional(tp: Any) -> Any:
    """``X | None`` -> ``X``; other types unchanged."""
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def _dataclass_of(tp: Any) -> type | None:
    tp = _unwrap_optional(tp)
    return tp if isinstance(tp, type) and is_dataclass(tp) else None


def _list_item_dataclass(tp: Any) -> type | None:
    tp = _unwrap_optional(tp)
    if typing.get_origin(tp) in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if len(args) == 1:
            return _dataclass_of(args[0])
    return None


def _check_unknown_keys(node: Any, cls: type, prefix: str) -> None:
    """Raise ValueError for the first key of ``node`` that ``cls`` does not have."""
    if not isinstance(node, dict):
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    for key, value in node.items():
        full = f"{prefix}{key}"
        if key not in hints or key not in names:
            close = difflib.get_close_matches(str(key), names, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""
            raise ValueError(f"Unknown config key '{full}' in {cls.__name__}{hint}")
        sub = _dataclass_of(hints[key])
        if sub is not None:
            if value is not None and not isinstance(value, dict) and not _is_interpolation(value):
                raise ValueError(
                    f"Config key '{full}' is a section ({describe_type(hints[key])}); "
                    f"got the value {value!r}"
                )
            _check_unknown_keys(value, sub, full + ".")
            continue
        item = _list_item_dataclass(hints[key])
        if item is not None and isinstance(value, list):
            for i, entry in enumerate(value):
                _check_unknown_keys(entry, item, f"{full}[{i}].")


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and value.strip().startswith("${")


def _split_argv(argv: list[str]) -> tuple[str, list[str]]:
    if argv and argv[0].endswith(".py"):
        argv = argv[1:]
    config_file = None
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a YAML file path after it")
            config_file = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        elif ("=" in arg and not arg.startswith("-")) or arg.startswith("~"):
            overrides.append(arg)
        else:
            raise ValueError(
                f"Cannot parse command-line argument {arg!r}; expected '--config FILE.yaml', "
                "'key.sub=value', '+key.sub=value' or '~key.sub'"
            )
        i += 1
    if config_file is None:
        raise ValueError("Missing '--config FILE.yaml' on the command line")
    return config_file, overrides


def _short(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _fill_subsection_names(cfg: DictConfig) -> None:
    """Missing or null experiment_name/trial_name/fileroot of a section default to the top-level ones."""
    for key in list(cfg.keys()):
        node = cfg._get_node(key)
        if not isinstance(node, DictConfig) or node._is_none() or node._is_missing():
            continue
        for name, ref in _SUBSECTION_DEFAULTS.items():
            if name not in node.keys():
                continue
            value_node = node._get_node(name)
            if OmegaConf.is_missing(node, name) or (
                value_node is not None and value_node._is_none()
            ):
                node[name] = ref


def describe_type(tp: Any) -> str:
    """Readable name of a field type: ``float | None`` -> ``'float | None'``, dataclasses by name."""
    if tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(describe_type(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else describe_type(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if inner else origin.__name__
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _field_type(config_cls: type, dotted: str) -> Any:
    """Declared type of ``a.b[0].c`` inside ``config_cls``, or None when it cannot be found."""
    tp: Any = config_cls
    for part in dotted.replace("]", "").replace("[", ".").split("."):
        if part.isdigit():
            tp = _list_item_dataclass(tp) or None
            if tp is None:
                return None
            continue
        cls = _dataclass_of(tp)
        if cls is None:
            return None
        tp = typing.get_type_hints(cls).get(part)
        if tp is None:
            return None
    return tp


def _type_error(config_cls: type, e: oc_errors.OmegaConfBaseException) -> ValueError:
    key = getattr(e, "full_key", None) or "?"
    tp = _field_type(config_cls, key)
    expected = describe_type(tp) if tp is not None else "the declared type"
    return ValueError(f"Config key '{key}' has the wrong type (expected {expected}): {_short(e)}")


def to_structured_cfg(cfg: Any, config_cls: type[ConfigT]) -> DictConfig:
    """Merge a plain/OmegaConf config over the defaults of ``config_cls`` (typed, validated keys)."""
    plain = (
        OmegaConf.to_container(cfg, resolve=False)
        if isinstance(cfg, (DictConfig, ListConfig))
        else cfg
    )
    _check_unknown_keys(plain or {}, config_cls, "")
    default_cfg = OmegaConf.structured(config_cls)
    try:
        merged = OmegaConf.merge(default_cfg, plain or {})
    except oc_errors.ValidationError as e:
        raise _type_error(config_cls, e) from None
    except (oc_errors.OmegaConfBaseException, TypeError) as e:
        key = getattr(e, "full_key", None) or "?"
        raise ValueError(f"Config key '{key}': {_short(e)}") from None
    _fill_subsection_names(merged)
    return merged


def _to_object(cfg: DictConfig, config_cls: type[ConfigT]) -> ConfigT:
    try:
        obj = OmegaConf.to_object(cfg)
    except oc_errors.MissingMandatoryValue as e:
        raise ValueError(f"Required config key '{e.full_key}' is missing") from None
    except oc_errors.InterpolationResolutionError as e:
        raise ValueError(
            f"Config key '{e.full_key}': cannot resolve interpolation: {_short(e)}"
        ) from None
    except oc_errors.ValidationError as e:
        raise _type_error(config_cls, e) from None
    except oc_errors.OmegaConfBaseException as e:
        raise ValueError(f"Config key '{getattr(e, 'full_key', '?')}': {_short(e)}") from None
    if not isinstance(obj, config_cls):
        raise ValueError(f"Loaded config is a {type(obj).__name__}, expected {config_cls.__name__}")
    return obj


def build_config(yaml_dict: dict, overrides: list[str], config_cls: type[ConfigT]) -> ConfigT:
    """Typed config from a YAML mapping plus command-line overrides (no file I/O).

    Overrides (AReaL / Hydra forms): ``a.b=v`` and ``+a.b=v`` / ``++a.b=v`` set a key,
    list items by index (``actor.scheduling_spec.0.gpu=0``); ``~a.b`` removes a key from
    the YAML (its default applies). Values are parsed as YAML (``[1,2]``, ``{k: v}``,
    ``null``, ``'quoted'``); ``${x.y}`` interpolations stay. With
    ``cluster.n_gpus_per_node=0`` the CPU fallbacks of ``apply_cpu_fallbacks`` apply.
    """
    plain = copy.deepcopy(yaml_dict or {})
    if not isinstance(plain, dict):
        raise ValueError(
            f"The config must be a mapping at the top level, got {type(plain).__name__}"
        )
    plain = _migrate_legacy_sections(plain, config_cls)
    for item in overrides:
        _apply_override(plain, item, config_cls)
    plain = _migrate_legacy_sections(plain, config_cls)
    structured = to_structured_cfg(plain, config_cls)
    config = _to_object(structured, config_cls)
    apply_cpu_fallbacks(config)
    warn_not_acted_on(config)
    return config


def _parse_override_value(key: str, raw: str) -> Any:
    """A command-line value as YAML would read it; ``a=`` is the empty string."""
    if raw == "":
        return ""
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]), resolve=False)["v"]
    except oc_errors.OmegaConfBaseException as e:
        raise ValueError(f"Override '{key}={raw}': cannot parse the value: {_short(e)}") from None


def _schema_default(config_cls: type, parts: list[str]) -> Any:
    """Plain default value at ``parts`` inside ``config_cls`` (None when there is none)."""
    try:
        node = OmegaConf.select(OmegaConf.structured(config_cls), ".".join(parts))
    except oc_errors.OmegaConfBaseException:
        return None
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=False)
    return node


def _apply_override(plain: dict, item: str, config_cls: type) -> None:
    """Apply one override (``a.b=v``, ``+a.b=v``, ``++a.b=v``, ``~a.b``) to ``plain``."""
    delete = item.startswith("~")
    key, sep, raw = item.lstrip("~+").partition("=")
    key = key.strip()
    if not key or (not sep and not delete):
        raise ValueError(
            f"Override {item!r}: expected 'key.sub=value', '+key.sub=value' or '~key.sub'"
        )
    parts = key.split(".")
    if any(not p for p in parts):
        raise ValueError(f"Override {item!r}: empty component in the key {key!r}")
    node: Any = plain
    for i, part in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, here, item)]
            continue
        child = node.get(part)
        if isinstance(child, str) and _is_interpolation(child):
            raise ValueError(
                f"Override {item!r}: '{here}' is the interpolation {child!r}; override what it "
                "points to, or give '{here}' a whole value"
            )
        if child is None or not isinstance(child, (dict, list)):
            default = _schema_default(config_cls, parts[: i + 1])
            child = default if isinstance(default, (dict, list)) else {}
            if delete and part not in node:
                return  # removing something that is not there
            node[part] = child
        node = child
    last = parts[-1]
    if isinstance(node, list):
        index = _list_index(node, last, key, item)
        if delete:
            node.pop(index)
        else:
            node[index] = _parse_override_value(key, raw)
        return
    if delete:
        node.pop(last, None)
    else:
        node[last] = _parse_override_value(key, raw)


def _list_index(node: list, part: str, here: str, item: str) -> int:
    if not part.isdigit():
        raise ValueError(f"Override {item!r}: '{here}' indexes a list; use a number, not {part!r}")
    index = int(part)
    if index >= len(node):
        raise ValueError(
            f"Override {item!r}: index {index} is out of range; the list has {len(node)} item(s)"
        )
    return index


def _rewrite_interpolations(node: Any, old: str, new: str) -> Any:
    if isinstance(node, dict):
        return {k: _rewrite_interpolations(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite_interpolations(v, old, new) for v in node]
    if isinstance(node, str) and "${" in node:
        return node.replace("${" + old + ".", "${" + new + ".").replace(
            "${" + old + "}", "${" + new + "}"
        )
    return node


def _migrate_legacy_sections(plain: dict, config_cls: type) -> dict:
    """Earlier section names -> current ones, with a warning.

    SFT / reward-model configs: ``model`` -> ``actor`` (interpolations ``${model.x}``
    follow). Keys under both names are merged, ``model``'s winning.
    """
    if not isinstance(plain, dict) or "model" not in plain:
        return plain
    names = {f.name for f in fields(config_cls)}
    if "actor" not in names or "model" in names:
        return plain
    plain = dict(plain)
    legacy = plain.pop("model")
    if "actor" in plain and isinstance(plain["actor"], dict) and isinstance(legacy, dict):
        legacy = OmegaConf.to_container(
            OmegaConf.merge(OmegaConf.create(plain["actor"]), OmegaConf.create(legacy)),
            resolve=False,
        )
    plain["actor"] = legacy
    plain = _rewrite_interpolations(plain, "model", "actor")
    warn_once(
        f"model-section-{config_cls.__name__}",
        f"{config_cls.__name__}: the `model` section is deprecated; it was read as `actor` "
        "(as in AReaL). Rename it in the YAML.",
    )
    return plain


def get_log_path(config: Any) -> str:
    """``{cluster.fileroot}/logs/{experiment_name}/{trial_name}``: logs and config.yaml live here."""
    return os.path.join(config.cluster.fileroot, "logs", config.experiment_name, config.trial_name)


def save_config(cfg: Any, log_dir: str) -> str:
    """Write ``cfg`` as ``log_dir/config.yaml`` (directories created); returns the file path."""
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(conf_as_dict(cfg), f, default_flow_style=False, sort_keys=False)
    return path


def _defaults_entry(
    entry: Any, here: Path, root: Path, where: str
) -> tuple[Path | None, str, bool]:
    """``(file, package, optional)`` of one ``defaults:`` entry of the YAML ``where``
    (Hydra's forms): ``path[@pkg]`` (a file, relative to the including file's folder
    ``here``; ``_self_`` handled by the caller) or ``{[optional |override ]group[@pkg]:
    option}`` (the file ``group/option.yaml`` of the search path ``root``, the primary
    config's folder; under ``group`` unless ``@pkg``). ``_global_`` = the top level.
    ``file`` None: a group entry whose option is ``null`` (nothing to merge)."""
    if isinstance(entry, str):
        ref, _, pkg = entry.strip().partition("@")
        group = os.path.dirname(ref).strip("./").replace("/", ".") if "/" in ref else ""
        return here / f"{ref}.yaml", pkg or group or "_global_", False
    if isinstance(entry, dict) and len(entry) == 1:
        ((key, option),) = entry.items()
        words = str(key).split()
        optional = "optional" in words[:-1]
        group, _, pkg = words[-1].partition("@")
        if option is None:
            return None, "", optional
        return root / group / f"{option}.yaml", pkg or group.replace("/", "."), optional
    raise ValueError(
        f"{where}: defaults entry {entry!r} is not a Hydra defaults entry "
        "('path[@package]', '_self_' or '{group: option}')"
    )


def compose_yaml(path: Path, _seen: tuple[Path, ...] = ()) -> DictConfig:
    """The YAML ``path`` with its Hydra ``defaults:`` list composed, as AReaL's Hydra
    loader composes it: each entry's file (its own defaults first) merged in list order,
    ``_self_`` (this file's own keys) where it stands, at the end when absent (Hydra 1.1+),
    so the file's own values win. A file without ``defaults`` is returned as loaded."""
    path = path.resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ValueError(f"Config defaults form a cycle: {chain}")
    try:
        loaded = OmegaConf.load(path)
    except FileNotFoundError:
        raise ValueError(f"Config file {str(path)!r} does not exist") from None
    except Exception as e:  # yaml errors come in several classes
        raise ValueError(f"Cannot parse YAML file {str(path)!r}: {_short(e)}") from None
    if not isinstance(loaded, DictConfig):
        raise ValueError(f"Config file {str(path)!r} must contain a mapping at the top level")
    if "defaults" not in loaded:
        return loaded
    entries = OmegaConf.to_container(loaded.defaults)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: 'defaults' must be a list (Hydra's defaults list)")
    own = OmegaConf.create({k: v for k, v in loaded.items_ex(resolve=False) if k != "defaults"})
    if "_self_" not in entries:
        entries.append("_self_")
    merged = OmegaConf.create()
    for entry in entries:
        if entry == "_self_":
            merged = OmegaConf.merge(merged, own)
            continue
        root = (_seen[0] if _seen else path).parent
        file, pkg, optional = _defaults_entry(entry, path.parent, root, str(path))
        if file is None or (optional and not file.is_file()):
            continue
        if not file.is_file():
            raise ValueError(f"{path}: defaults entry {entry!r}: {str(file)!r} does not exist")
        part = compose_yaml(file, (*_seen, path))
        if pkg != "_global_":
            for key in reversed(pkg.split(".")):
                part = OmegaConf.create({key: part})
        merged = OmegaConf.merge(merged, part)
    return merged


def load_expr_config(argv: list[str], config_cls: type[ConfigT]) -> tuple[ConfigT, str]:
    """Load ``--config FILE.yaml`` plus overrides into ``config_cls``.

    Returns ``(config, absolute path of the YAML file)``. A Hydra ``defaults:`` list in
    the YAML is composed first (``compose_yaml``). Overrides are ``a.b=value``;
    ``+a.b=value`` (Hydra's form for keys absent from the YAML) is accepted as well.
    Sub-sections whose experiment_name / trial_name / fileroot are not given inherit
    the top-level values. Errors (unknown key, wrong type, invalid value, missing
    required key) are ValueErrors naming the dotted key. On rank 0 (env RANK unset or
    0) the resolved config is written to ``get_log_path(config)/config.yaml``.
    """
    config_file, overrides = _split_argv(list(argv))
    path = Path(config_file).absolute()
    if not path.is_file():
        raise ValueError(f"Config file {str(path)!r} does not exist")
    loaded = compose_yaml(path)
    config = build_config(OmegaConf.to_container(loaded, resolve=False), overrides, config_cls)
    if os.environ.get("RANK", "0") == "0":
        saved = save_config(config, get_log_path(config))
        logger.info(f"Resolved config written to {saved}")
    return config, str(path)
