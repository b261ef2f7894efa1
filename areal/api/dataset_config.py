"""Dataset configs: ``TrainDatasetConfig`` / ``ValidDatasetConfig``.

Re-exported by ``areal.api.cli_args``; import from there or from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from areal.api.config_common import NOT_ACTED, cfield, check_range
from areal.api.engine_config import SchedulingSpec


@dataclass
class DatasetConfig:
    """A dataset and its dataloader."""

    path: str = cfield(
        MISSING, "Dataset location: a local file/directory (nothing is downloaded at run time)."
    )
    type: str = cfield(MISSING, "What the samples are used for: 'sft' or 'rl'.")
    split: str = cfield("train", "Dataset split to load, e.g. 'train' or 'test'.")
    dataset_kwargs: dict[str, Any] = cfield(
        help="Extra keyword arguments passed to the dataset loader.", factory=dict
    )
    batch_size: int = cfield(1, "Prompts per batch (per training step); >= 1.")
    shuffle: bool = cfield(True, "Shuffle every epoch.")
    max_length: int | None = cfield(
        None, "Drop samples whose prompt is longer than this many tokens; None: keep all."
    )
    drop_last: bool = cfield(True, "Drop the last incomplete batch.")
    pin_memory: bool = cfield(False, "Pin host memory (GPU training only).")
    num_workers: int = cfield(0, "Dataloader worker processes; >= 0.")
    num_dataset_workers: int = cfield(1, "Workers of AReaL's remote data service. " + NOT_ACTED)
    scheduling_spec: SchedulingSpec | None = cfield(
        help="Resources of AReaL's remote data-service workers. " + NOT_ACTED,
        factory=lambda: SchedulingSpec(cpu=1, gpu=0, mem=10),
    )
    setup_timeout: float = cfield(
        120.0, "Seconds the remote data service may take to load a dataset. " + NOT_ACTED
    )

    def __post_init__(self):
        owner = type(self).__name__
        check_range(owner, "batch_size", self.batch_size, ge=1)
        check_range(owner, "num_workers", self.num_workers, ge=0)
        check_range(owner, "max_length", self.max_length, ge=1, optional=True)


# AReaL's name of the shared base of the dataset sections.
_DatasetConfig = DatasetConfig


@dataclass
class TrainDatasetConfig(DatasetConfig):
    """The training dataset."""


@dataclass
class ValidDatasetConfig(DatasetConfig):
    """The validation dataset; split 'test', not shuffled, keeps its last batch by default."""

    split: str = cfield("test", "Dataset split to load, e.g. 'train' or 'test'.")
    shuffle: bool = cfield(False, "Shuffle every epoch.")
    drop_last: bool = cfield(False, "Drop the last incomplete batch.")
