"""Trajectory dumping (``config.dump_to_file``): every finished trajectory as text.

AReaL's layout: ``{fileroot}/logs/{experiment_name}/{trial_name}/{rollout|eval-rollout}/
{newest token version}/{task_id}.jsonl``, one JSON line per row (prompt, completion,
reward, lengths), decoded with ``config.tokenizer_path``. ``TrajectoryDumper.dump`` loads
the tokenizer once and writes off the event loop (``asyncio.to_thread``); a dump never
fails a rollout (it logs a warning instead).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Any

from areal.api.inference_config import InferenceEngineConfig
from areal.infra.rollout.rollout_results import is_tensor_dict
from areal.utils.hf_utils import load_hf_tokenizer

__all__ = ["TrajectoryDumper", "dump_records", "write_dump"]


class TrajectoryDumper:
    """Writes trajectories of one executor as text (module docstring)."""

    def __init__(self, config: InferenceEngineConfig, logger: Any):
        self.config = config
        self.logger = logger
        self._dump_tokenizer: Any = None
        self._dump_lock = threading.Lock()
        self._dump_warned = False

    def _load_dump_tokenizer(self, path: str) -> Any:
        with self._dump_lock:  # one import/load even when several dumps start at once
            if self._dump_tokenizer is None:
                self._dump_tokenizer = load_hf_tokenizer(path)
            return self._dump_tokenizer

    async def dump(self, traj: Any, task_id: int, is_eval: bool) -> None:
        """``dump_to_file``: write ``traj`` as text (module docstring); never raises."""
        cfg = self.config
        root, exp, trial = cfg.fileroot, cfg.experiment_name, cfg.trial_name
        tok_path = cfg.tokenizer_path
        if not (root and exp and trial and tok_path) or not is_tensor_dict(traj):
            if not self._dump_warned:
                self._dump_warned = True
                self.logger.warning(
                    "dump_to_file: needs rollout.fileroot, experiment_name, trial_name, "
                    "tokenizer_path and tensor trajectories; not dumping"
                )
            return
        try:
            if self._dump_tokenizer is None:
                self._dump_tokenizer = await asyncio.to_thread(self._load_dump_tokenizer, tok_path)
            versions = traj.get("versions")
            gen = traj["loss_mask"].bool()
            tail = int(versions[gen].max()) if versions is not None and bool(gen.any()) else 0
            sub = "eval-rollout" if is_eval else "rollout"
            path = os.path.join(root, "logs", exp, trial, sub, str(tail), f"{task_id}.jsonl")
            await asyncio.to_thread(write_dump, path, traj, self._dump_tokenizer, task_id)
        except Exception as e:  # a dump must never fail a rollout
            self.logger.warning("dump_to_file: could not dump rollout %d: %r", task_id, e)


def dump_records(traj: dict[str, Any], tokenizer: Any, task_id: int) -> list[dict[str, Any]]:
    """One text record per row of a padded trajectory (rows without completion skipped)."""
    ids, attn = traj["input_ids"], traj["attention_mask"].bool()
    loss = traj["loss_mask"].bool()
    rewards = traj["rewards"].float().reshape(-1).tolist()
    out = []
    for i in range(ids.shape[0]):
        row = ids[i][attn[i]].tolist()
        gen = loss[i][attn[i]]
        n_gen = int(gen.sum())
        if n_gen == 0:
            continue
        prompt_len = len(row) - n_gen
        out.append(
            dict(
                task_id=task_id,
                sample_idx=i,
                seqlen=len(row),
                prompt_len=prompt_len,
                reward=rewards[i],
                prompt=tokenizer.decode(row[:prompt_len], skip_special_tokens=False),
                completion=tokenizer.decode(row[prompt_len:], skip_special_tokens=False),
            )
        )
    return out


def write_dump(path: str, traj: dict[str, Any], tokenizer: Any, task_id: int) -> None:
    records = dump_records(traj, tokenizer, task_id)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
