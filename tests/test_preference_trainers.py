"""RWTrainer / DPOTrainer end to end on a tiny model: a resume on two ranks from one rank's
recover checkpoint trains and evaluates as the one rank going on (real workers, gloo)."""

from __future__ import annotations

import os

import pytest

from areal.api.cli_args import DPOConfig, RWConfig, load_expr_config

HERE = os.path.dirname(__file__)
RW_YAML = os.path.join(HERE, "..", "examples", "alignment", "rw_cpu.yaml")
DPO_YAML = os.path.join(HERE, "..", "examples", "alignment", "dpo_cpu.yaml")


def _run(kind: str, model_dir: str, fileroot: str, *extra: str):
    from areal.dataset import get_custom_dataset
    from areal.trainer.dpo_trainer import DPOTrainer
    from areal.trainer.rw_trainer import RWTrainer
    from areal.utils.hf_utils import load_hf_tokenizer

    yaml, cls, trainer_cls = {
        "rw": (RW_YAML, RWConfig, RWTrainer),
        "dpo": (DPO_YAML, DPOConfig, DPOTrainer),
    }[kind]
    cfg, _ = load_expr_config(
        [
            "--config", yaml,
            f"actor.path={model_dir}",
            f"cluster.fileroot={fileroot}",
            "train_dataset.path=synthetic://arith_pref?n=64&seed=5",
            "train_dataset.batch_size=8",
            "valid_dataset.path=synthetic://arith_pref?n=16&seed=5",
            "valid_dataset.batch_size=16",
            "evaluator.freq_steps=null",
            "actor.optimizer.warmup_steps_proportion=0.0",
            *extra,
        ],
        cls,
    )  # fmt: skip
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    valid = get_custom_dataset("test", cfg.valid_dataset, tok)
    with trainer_cls(cfg, train_dataset=train, valid_dataset=valid) as trainer:
        result = trainer.train()
        result["eval"] = trainer.evaluate()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rw", "dpo"])
def test_preference_trainer_resumes_on_two_ranks_as_one_rank_goes_on(kind, tiny_lm_dir, tmp_path):
    """Three runs: one rank straight through 3 steps; one rank for 2 steps writing a
    recover checkpoint each step; two ranks resuming that checkpoint for the last step.
    The resumed step (on the other layout) must be the straight run's third step, and the
    two ranks must evaluate the final model as the one rank does."""
    straight = _run(kind, tiny_lm_dir, str(tmp_path / "a"), "total_train_steps=3")
    rec = ("recover.mode=auto", "recover.freq_steps=1")
    first = _run(kind, tiny_lm_dir, str(tmp_path / "b"), "total_train_steps=2", *rec)
    resumed = _run(
        kind, tiny_lm_dir, str(tmp_path / "b"), "total_train_steps=3", "allocation_mode=fsdp:d2",
        *rec,
    )  # fmt: skip
    assert first["losses"] == pytest.approx(straight["losses"][:2], rel=1e-5, abs=1e-6)
    # the steps changed the model: the loss moved away from the starting point
    assert straight["losses"][1] != pytest.approx(straight["losses"][0], abs=1e-6)
    assert len(resumed["losses"]) == 1  # only the remaining step ran
    assert resumed["losses"][0] == pytest.approx(straight["losses"][2], rel=1e-4, abs=1e-5)
    assert set(resumed["eval"]) == set(straight["eval"])
    for k, v in straight["eval"].items():
        assert resumed["eval"][k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
