"""The one-thread float32 ``TrainEngineConfig`` of the tiny test model, shared by tests
and benchmarks that start a real ``FSDPEngine``."""

from __future__ import annotations

from typing import Any


def tiny_train_config(path: str, experiment_name: str = "t", **optimizer: Any):
    """``TrainEngineConfig`` for ``path`` (float32, one thread, unbounded micro-batches);
    ``optimizer`` overrides ``OptimizerConfig`` fields (default ``lr=1e-3``)."""
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig

    return TrainEngineConfig(
        experiment_name=experiment_name,
        trial_name="t",
        path=path,
        dtype="float32",
        optimizer=OptimizerConfig(**{"lr": 1e-3, **optimizer}),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=None),
        num_threads=1,
    )
