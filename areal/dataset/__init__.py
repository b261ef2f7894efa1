"""Dataset loaders: ``get_custom_dataset(split, dataset_config, tokenizer)``.

Dispatch on ``dataset_config.path``:

- ``synthetic://arith?digits=1&steps=2&ops=add,sub&n=5000&seed=0``: synthetic arithmetic
  word problems in GSM8K format (see :mod:`areal.dataset.synthetic`).
- a path containing ``gsm8k`` (a ``.jsonl``/``.json``/``.parquet`` file, or a directory
  holding ``{split}.jsonl`` / ``{split}.parquet``): GSM8K (see :mod:`areal.dataset.gsm8k`).
- any other local file/directory with ``question``/``answer`` rows is read the same way.

``dataset_config.type`` selects the row format: ``"rl"`` -> ``messages`` + ``answer``;
``"sft"`` -> ``input_ids`` + ``loss_mask``. ``dataset_config.max_length`` drops longer
rows (counted in the log). Nothing is downloaded at run time.
"""

from __future__ import annotations

from typing import Any

from areal.dataset.gsm8k import build_gsm8k_dataset, get_gsm8k_dataset
from areal.dataset.synthetic import (
    ArithSpec,
    generate_arith_problems,
    is_synthetic_path,
    parse_synthetic_path,
)
from areal.utils import logging

logger = logging.getLogger("Dataset")

VALID_DATASETS = ["gsm8k (local file/dir)", "synthetic://arith?..."]

__all__ = [
    "ArithSpec",
    "VALID_DATASETS",
    "generate_arith_problems",
    "get_custom_dataset",
    "get_gsm8k_dataset",
    "parse_synthetic_path",
]


def get_custom_dataset(
    split: str,
    dataset_config: Any,
    tokenizer: Any = None,
    processor: Any = None,
    *,
    max_bad_fraction: float = 0.1,
    prompt_suffix: str | None = None,
    **kwargs: Any,
):
    """Build the dataset described by ``dataset_config`` (``path``, ``type``, ``max_length``).

    Args:
        split: ``"train"``, ``"test"``, ... (file name in a directory; stream for synthetic).
        dataset_config: a ``DatasetConfig`` (or anything with ``path``/``type``/``max_length``).
        tokenizer: needed for ``max_length`` filtering and for ``type="sft"``.
        processor: accepted for AReaL compatibility (no multimodal datasets here).
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
    path = getattr(dataset_config, "path", None)
    dtype = getattr(dataset_config, "type", None) or "rl"
    max_length = getattr(dataset_config, "max_length", None)
    if not isinstance(path, str) or not path:
        raise ValueError(
            f"dataset path={path!r}; must be a local file/directory or 'synthetic://...'"
        )
    if dtype not in ("rl", "sft"):
        raise ValueError(f"dataset type={dtype!r}; allowed: 'rl', 'sft'")
    if is_synthetic_path(path):
        spec = parse_synthetic_path(path)
        rows = generate_arith_problems(spec, split=split)
        return build_gsm8k_dataset(
            rows, dtype, tokenizer, max_length, prompt_suffix or "", source=f"{path}[{split}]"
        )
    return get_gsm8k_dataset(
        path,
        split,
        type=dtype,
        tokenizer=tokenizer,
        max_length=max_length,
        max_bad_fraction=max_bad_fraction,
        prompt_suffix=prompt_suffix,
    )
