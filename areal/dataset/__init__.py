"""Dataset loaders: ``get_custom_dataset(split, dataset_config, tokenizer)``.

Dispatch on ``dataset_config.path``:

- ``synthetic://arith?digits=1&steps=2&ops=add,sub&n=5000&seed=0``: synthetic arithmetic
  word problems in GSM8K format (see :mod:`areal.dataset.synthetic`).
- a path containing ``gsm8k`` (a ``.jsonl``/``.json``/``.parquet`` file, or a directory
  holding ``{split}.jsonl`` / ``{split}.parquet``): GSM8K (see :mod:`areal.dataset.gsm8k`).
- any other local file/directory with ``question``/``answer`` rows is read the same way.
- ``reasoning_gym://chain_sum?size=2000&seed=0&max_digits=1`` (or a weighted mix
  ``reasoning_gym://chain_sum:3,basic_arithmetic:1?...``): a Reasoning Gym task (the
  ``envs`` extra), scored by :func:`areal.reward.reasoning_gym.reasoning_gym_reward_fn`
  with the task's own ``score_answer`` (see :mod:`areal.dataset.reasoning_gym`).
- a hub id (``openai/gsm8k``): its snapshot in the Hugging Face cache (downloaded when the
  hub is reachable and ``HF_HUB_OFFLINE`` is unset, see
  :func:`areal.utils.hf_utils.resolve_hub_path`), read as a directory; the subset
  directory is ``dataset_kwargs["name"]`` (default ``main``, as AReaL loads GSM8K).

- a path containing ``geometry3k`` or ``clevr_count_70k`` (local files in the released
  layout), or ``synthetic://clevr?query=color&max_count=4&n=2000`` (Pillow counting scenes,
  :mod:`areal.dataset.synthetic_clevr`): image question answering, see
  :mod:`areal.dataset.vision` (RL rows: ``messages`` with image parts, ``images``,
  ``answer``).

``dataset_config.type`` selects the row format: ``"rl"`` -> ``messages`` + ``answer``;
``"sft"`` -> ``input_ids`` + ``loss_mask``; ``"rw"`` / ``"dpo"`` -> preference pairs
(``chosen_ids`` / ``rejected_ids``, plus ``*_loss_mask`` for DPO) from HH-RLHF files
(:mod:`areal.dataset.hhrlhf`) or ``synthetic://arith_pref?...`` (correct vs off-by-one
answers to the synthetic problems, prompt rendered by the tokenizer's chat template).
``dataset_config.max_length`` drops longer rows (counted in the log). ``split`` defaults to ``dataset_config.split``;
``dataset_config.dataset_kwargs`` may hold ``name`` (hub subset) and ``revision``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal.dataset.gsm8k import build_gsm8k_dataset, get_gsm8k_dataset
from areal.dataset.reasoning_gym import is_reasoning_gym_path
from areal.dataset.synthetic import (
    ArithSpec,
    generate_arith_problems,
    is_synthetic_path,
    parse_synthetic_path,
    synthetic_kind,
)
from areal.utils import logging

if TYPE_CHECKING:
    from areal.api.dataset_config import DatasetConfig

logger = logging.getLogger("Dataset")

VALID_DATASETS = [
    "geometry3k (local file/dir, type rl|sft)",
    "clevr_count_70k (local file/dir, type rl|sft)",
    "synthetic://clevr?... (type rl|sft)",
    "gsm8k (local file/dir)",
    "synthetic://arith?...",
    "hh-rlhf (local file/dir, type rw|dpo)",
    "synthetic://arith_pref?... (type rw|dpo)",
    "reasoning_gym://<task>[:w,<task>:w]?size=N&seed=S&... (type rl)",
]

__all__ = [
    "ArithSpec",
    "VALID_DATASETS",
    "default_reward_fn",
    "generate_arith_problems",
    "get_custom_dataset",
    "get_gsm8k_dataset",
    "parse_synthetic_path",
]


def get_custom_dataset(
    split: str | None = None,
    dataset_config: DatasetConfig | None = None,
    tokenizer: Any = None,
    processor: Any = None,
    *,
    max_bad_fraction: float = 0.1,
    prompt_suffix: str | None = None,
    **kwargs: Any,
):
    """Build the dataset described by ``dataset_config`` (``path``, ``type``, ``max_length``).

    Args:
        split: ``"train"``, ``"test"``, ... (file name in a directory; stream for
            synthetic); ``None``: ``dataset_config.split`` (else ``"train"``).
        dataset_config: a ``DatasetConfig`` (``path``, ``type``, ``split``, ``max_length``,
            ``dataset_kwargs``), e.g. ``config.train_dataset``.
        tokenizer: needed for ``max_length`` filtering and for ``type="sft"``.
        processor: the VLM's processor (``AutoProcessor``) for vision datasets with
            ``type="sft"`` or ``max_length``; ignored by text datasets.
        max_bad_fraction: raise ``ValueError`` when more rows than this are unusable.
        prompt_suffix: text appended to the question in the user message (default: the
            boxed-answer request for GSM8K RL, nothing for synthetic problems).
        kwargs: ``rank``/``world_size`` are accepted and ignored (sharding is done by
            :func:`areal.utils.dataloader.create_dataloader`); anything else is an error.

    Returns:
        a ``datasets.Dataset``.
    """
    kwargs.pop("rank", None)
    kwargs.pop("world_size", None)
    if kwargs:
        raise TypeError(f"get_custom_dataset got unexpected argument(s) {sorted(kwargs)}")
    if dataset_config is None:
        raise ValueError("get_custom_dataset needs dataset_config (path, type, max_length)")
    if split is None:
        split = dataset_config.split or "train"
    ds_kwargs = dict(dataset_config.dataset_kwargs or {})
    unknown = sorted(set(ds_kwargs) - {"name", "revision"})
    if unknown:
        raise ValueError(
            f"dataset_kwargs {unknown} are not understood by this loader; allowed: 'name' "
            "(hub subset directory), 'revision' (hub revision)"
        )
    path = dataset_config.path
    dtype = dataset_config.type or "rl"
    max_length = dataset_config.max_length
    if not isinstance(path, str) or not path:
        raise ValueError(
            f"dataset path={path!r}; must be a local file/directory or 'synthetic://...'"
        )
    if dtype not in ("rl", "sft", "rw", "dpo"):
        raise ValueError(f"dataset type={dtype!r}; allowed: 'rl', 'sft', 'rw', 'dpo'")
    if dtype in ("rw", "dpo"):
        return _get_preference_dataset(
            path, split, dtype, tokenizer, max_length, max_bad_fraction, ds_kwargs
        )
    if is_reasoning_gym_path(path):
        from areal.dataset.reasoning_gym import get_reasoning_gym_dataset

        return get_reasoning_gym_dataset(
            path, split, dtype, tokenizer, max_length, prompt_suffix or ""
        )
    if _is_vision_path(path):
        return _get_vision_dataset(
            path, split, dtype, processor, max_length, max_bad_fraction, prompt_suffix
        )
    if is_synthetic_path(path):
        if synthetic_kind(path) != "arith":
            raise ValueError(
                f"dataset path={path!r} holds preference pairs; use type 'rw' or 'dpo' "
                f"(got type={dtype!r})"
            )
        spec = parse_synthetic_path(path)
        rows = generate_arith_problems(spec, split=split)
        return build_gsm8k_dataset(
            rows, dtype, tokenizer, max_length, prompt_suffix or "", source=f"{path}[{split}]"
        )
    from areal.utils.hf_utils import is_hub_id, resolve_hub_path

    if is_hub_id(path):
        path = resolve_hub_path(path, "dataset", revision=ds_kwargs.get("revision"))
    return get_gsm8k_dataset(
        path,
        split,
        type=dtype,
        tokenizer=tokenizer,
        max_length=max_length,
        max_bad_fraction=max_bad_fraction,
        prompt_suffix=prompt_suffix,
        name=ds_kwargs.get("name"),
    )


def default_reward_fn(path: str | None) -> str:
    """The import path of the reward function for rows of dataset ``path``: Reasoning Gym's
    ``score_answer`` for ``reasoning_gym://`` paths, else the GSM8K reward."""
    if is_reasoning_gym_path(path):
        return "areal.reward.reasoning_gym.reasoning_gym_reward_fn"
    return "areal.reward.gsm8k.gsm8k_reward_fn"


def _is_vision_path(path: str) -> bool:
    from areal.dataset.synthetic_clevr import is_clevr_path

    low = path.lower()
    return is_clevr_path(path) or "geometry3k" in low or "clevr_count_70k" in low


def _get_vision_dataset(path, split, dtype, processor, max_length, max_bad_fraction, suffix):
    """Geometry3K / CLEVR-Count-70K files or ``synthetic://clevr`` (types rl, sft)."""
    from areal.dataset import clevr_count_70k, geometry3k

    if dtype not in ("rl", "sft"):
        raise ValueError(f"dataset {path!r}: type={dtype!r}; vision datasets allow 'rl', 'sft'")
    if "geometry3k" in path.lower():
        if dtype == "rl":
            return geometry3k.get_geometry3k_rl_dataset(
                path, split, processor, max_length, max_bad_fraction, suffix
            )
        return geometry3k.get_geometry3k_sft_dataset(
            path, split, processor, max_length, max_bad_fraction
        )
    if dtype == "rl":
        return clevr_count_70k.get_clevr_count_70k_rl_dataset(
            path, split, processor, max_length, max_bad_fraction, suffix
        )
    return clevr_count_70k.get_clevr_count_70k_sft_dataset(
        path, split, processor, max_length, max_bad_fraction
    )


def _get_preference_dataset(path, split, dtype, tokenizer, max_length, max_bad_fraction, kw):
    from areal.dataset.hhrlhf import build_preference_dataset, get_hhrlhf_dataset

    if is_synthetic_path(path):
        if synthetic_kind(path) != "arith_pref":
            raise ValueError(
                f"type={dtype!r} needs preference pairs: use 'synthetic://arith_pref?...' "
                f"(got {path!r})"
            )
        from areal.dataset.synthetic import generate_arith_preference_pairs

        if tokenizer is None:
            raise ValueError(f"{path}: type={dtype!r} needs a tokenizer")
        pairs = []
        for r in generate_arith_preference_pairs(parse_synthetic_path(path), split):
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": r["question"]}],
                add_generation_prompt=True,
                tokenize=False,
            )
            pairs.append((prompt, r["chosen"], r["rejected"]))
        return build_preference_dataset(pairs, dtype, tokenizer, max_length, f"{path}[{split}]")
    from areal.utils.hf_utils import is_hub_id, resolve_hub_path

    if is_hub_id(path):
        path = resolve_hub_path(path, "dataset", revision=kw.get("revision"))
    return get_hhrlhf_dataset(
        path, split, dtype, tokenizer, max_length=max_length, max_bad_fraction=max_bad_fraction
    )
