"""Hugging Face helpers: hub ids -> local directories, tokenizer / processor loading.

A model or dataset path is either a local path or a Hugging Face hub id
(``Qwen/Qwen2.5-0.5B-Instruct``, ``openai/gsm8k``). :func:`resolve_hub_path` turns a hub
id into the directory of its snapshot in the Hugging Face cache (``HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), downloading it when the hub is
reachable and ``HF_HUB_OFFLINE`` is not set. Offline (or unreachable) and not cached:
one ``FileNotFoundError`` naming the id, the cache directory and ``HF_HUB_OFFLINE``.
The trainers resolve every model path of the config once, in the controller, so workers
and inference servers always receive local directories.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Any

from areal.utils import logging

logger = logging.getLogger("HFUtils")

# owner/name (or a bare name) made of hub-legal characters
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
# What a model snapshot needs (weights, configs, tokenizer files, chat template).
MODEL_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_TRUE = ("1", "true", "yes", "on")


def hub_cache_dir() -> str:
    """The Hugging Face hub cache directory as the environment says it now."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "huggingface", "hub")


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set."""
    return any(
        os.environ.get(k, "").strip().lower() in _TRUE
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def is_hub_id(path: Any) -> bool:
    """``path`` is not a local path and looks like a hub id (``owner/name``)."""
    if not isinstance(path, str) or not path or os.path.exists(os.path.expanduser(path)):
        return False
    return bool(_HUB_ID.match(path)) and not path.startswith(".")


def resolve_hub_path(
    path: str,
    repo_type: str = "model",
    allow_patterns: list[str] | None = None,
    revision: str | None = None,
) -> str:
    """A local path unchanged; a hub id -> its snapshot directory in the HF cache.

    Downloads when the hub is reachable and ``HF_HUB_OFFLINE`` is unset; otherwise only
    the cache is read. Raises ``FileNotFoundError`` (id, cache directory, offline flag)
    when the id is neither local nor cached and cannot be downloaded.
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"model/dataset path must be a non-empty string, got {path!r}")
    local = os.path.expanduser(path)
    if os.path.exists(local):
        return local
    if not is_hub_id(path):
        raise FileNotFoundError(f"path {path!r} does not exist (and is not a hub id 'owner/name')")
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    offline = hub_offline()
    kwargs = dict(
        repo_id=path,
        repo_type=repo_type,
        cache_dir=cache,
        revision=revision,
        allow_patterns=allow_patterns,
    )
    error: Exception | None = None
    if not offline:
        try:
            out = snapshot_download(**kwargs)
            logger.info("Hub %s %s -> %s", repo_type, path, out)
            return out
        except Exception as e:  # unreachable hub, missing repo, ...: try the cache
            error = e
            logger.warning(
                "Could not download %s %r (%s); looking in the cache", repo_type, path, e
            )
    try:
        out = snapshot_download(local_files_only=True, **kwargs)
    except Exception as e:
        why = f"download failed ({error}); " if error is not None else ""
        raise FileNotFoundError(
            f"{repo_type} {path!r} is not a local path and is not in the Hugging Face cache "
            f"{cache} ({why}HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '')!r}). "
            f"Download it where the hub is reachable (huggingface-cli download "
            f"{'--repo-type dataset ' if repo_type == 'dataset' else ''}{path}) into that "
            "cache, point HF_HOME/HF_HUB_CACHE at a cache holding it, or give a local path."
        ) from e
    logger.info("Hub %s %s -> %s (cache)", repo_type, path, out)
    return out


def resolve_model_path(path: str) -> str:
    """:func:`resolve_hub_path` for models (weights, configs, tokenizer files only)."""
    return resolve_hub_path(path, "model", allow_patterns=MODEL_ALLOW_PATTERNS)


_MODEL_PATH_FIELDS = (
    ("actor", "path"),
    ("ref", "path"),
    ("critic", "path"),
    ("model", "path"),
    ("teacher", "path"),
    ("vllm", "model"),
    ("sglang", "model_path"),
)


def resolve_config_hub_paths(config: Any) -> dict[str, str]:
    """Replace every hub id among the config's model paths by its local snapshot (in place).

    Covers ``actor/ref/critic/model/teacher.path``, ``tokenizer_path``, ``vllm.model`` and
    ``sglang.model_path``; returns ``{field: local_dir}`` of what changed.
    """
    changed: dict[str, str] = {}
    resolved: dict[str, str] = {}
    targets = [(getattr(config, sec, None), sec, f) for sec, f in _MODEL_PATH_FIELDS]
    targets.append((config, "", "tokenizer_path"))
    for obj, sec, name in targets:
        value = getattr(obj, name, None) if obj is not None else None
        if not is_hub_id(value):
            continue
        if value not in resolved:
            resolved[value] = resolve_model_path(value)
        setattr(obj, name, resolved[value])
        changed[f"{sec}.{name}" if sec else name] = resolved[value]
    return changed


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, Any]], *, tokenize: bool = True, **kwargs: Any
):
    """``tokenizer.apply_chat_template`` returning ``list[int]`` when ``tokenize`` (AReaL's helper).

    transformers 5 returns a dict (``input_ids`` ...) or a tensor for ``tokenize=True``;
    this always gives a flat list of ids. ``enable_thinking=False`` is dropped (templates
    without thinking support ignore it anyway).
    """
    if kwargs.get("enable_thinking") is False:
        kwargs.pop("enable_thinking")
    out = tokenizer.apply_chat_template(messages, tokenize=tokenize, **kwargs)
    if not tokenize:
        return out
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


@lru_cache(maxsize=8)
def _load_tokenizer_cached(path: str, fast_tokenizer: bool, padding_side: str | None):
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"use_fast": fast_tokenizer, "trust_remote_code": False}
    if padding_side is not None:
        kwargs["padding_side"] = padding_side
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    if tok.pad_token_id is None:
        if tok.eos_token is not None:
            tok.pad_token = tok.eos_token
            logger.info("Tokenizer at %s has no pad token; using EOS %r", path, tok.eos_token)
        else:
            tok.add_special_tokens({"pad_token": "<|pad|>"})
            logger.warning("Tokenizer at %s has neither pad nor EOS token; added '<|pad|>'", path)
    return tok


def load_hf_tokenizer(
    model_name_or_path: str, fast_tokenizer: bool = True, padding_side: str | None = None
):
    """``AutoTokenizer.from_pretrained`` with a pad token guaranteed (EOS if missing).

    Cached per (path, fast_tokenizer, padding_side): callers get the same object, so do
    not mutate it. ``padding_side`` is ``"left"``/``"right"``/``None`` (tokenizer default).
    """
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"padding_side={padding_side!r}; allowed: None, 'left', 'right'")
    path = resolve_model_path(str(model_name_or_path))
    return _load_tokenizer_cached(path, bool(fast_tokenizer), padding_side)


def load_hf_processor_and_tokenizer(
    model_name_or_path: str, fast_tokenizer: bool = True, padding_side: str | None = None
):
    """(processor or None, tokenizer). Text-only models have no processor."""
    model_name_or_path = resolve_model_path(str(model_name_or_path))
    tokenizer = load_hf_tokenizer(model_name_or_path, fast_tokenizer, padding_side)
    processor = None
    try:
        from transformers import AutoProcessor

        candidate = AutoProcessor.from_pretrained(str(model_name_or_path))
        # For text-only models AutoProcessor falls back to the tokenizer itself.
        if not hasattr(candidate, "pad_token_id") or hasattr(candidate, "image_processor"):
            processor = candidate
    except Exception as e:  # no processor config: a text-only model
        logger.debug("No processor for %s: %s", model_name_or_path, e)
    return processor, tokenizer
