"""Recover checkpoints: everything a crashed run needs to continue as if nothing happened.

A checkpoint directory ``{fileroot}/checkpoints/{experiment}/{trial}/recover/step{N:08d}``
holds ``model/`` (sharded DCP of model + optimizer + LR scheduler, written by the train
engine) and ``recover_info.pt`` (step, dataloader state, saver/evaluator/stats-logger
state, RNG states, the version the inference servers had). It is first written to a
``.tmp-*`` directory, completed with a ``COMPLETE`` marker and then renamed into place, so a
process killed half-way never leaves a directory that :meth:`RecoverHandler.load` accepts.
Before the marker, ``MANIFEST.json`` records the size and CRC-32 of every file; ``load``
verifies them and, when a file is truncated or altered although the marker is there (a
full disk, a copy cut short, a filesystem that lost data on a crash), logs which file and
falls back to the previous complete checkpoint.
The last ``KEEP_LAST`` (2) complete checkpoints are kept.

Asynchronous saves (``recover.save_mode``: ``async``, or ``auto`` with a large state, see
``SaveLoadMeta.save_mode``): the engine copies its state to CPU memory and writes it in the
background while training continues; the manifest, the marker and the rename come only
after that write has finished, at the next checkpoint or at :meth:`RecoverHandler.close`
(shutdown), so a process killed during the write leaves the previous checkpoint as the
newest complete one.

Modes (``recover.mode``): ``disabled``: nothing written, never resumed. ``off``: written,
never resumed (every run starts fresh). ``on`` / ``auto``: written, and a rerun of the same
experiment/trial resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from areal.api.io_struct import FinetuneSpec, SaveLoadMeta, StepInfo
from areal.utils import logging
from areal.utils.timeutil import EpochStepTimeFreqCtl

if TYPE_CHECKING:
    from areal.api.utils_config import RecoverConfig

logger = logging.getLogger("RecoverHandler")

_MARKER = "COMPLETE"
_INFO = "recover_info.pt"
_MANIFEST = "MANIFEST.json"
_CHUNK = 16 * 1024 * 1024
# complete recovery checkpoints kept on disk (older ones are deleted)
KEEP_LAST = 2


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel not in (_MARKER, _MANIFEST):
                out.append(rel)
    return sorted(out)


def write_manifest(ckpt_dir: str) -> dict:
    """Record size and CRC-32 of every file of ``ckpt_dir`` in ``MANIFEST.json``."""
    files = {
        rel: {
            "size": os.path.getsize(os.path.join(ckpt_dir, rel)),
            "crc32": _crc32(os.path.join(ckpt_dir, rel)),
        }
        for rel in _files(ckpt_dir)
    }
    with open(os.path.join(ckpt_dir, _MANIFEST), "w") as f:
        json.dump({"files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    return files


def verify_checkpoint(ckpt_dir: str) -> str | None:
    """``None`` when every file of the manifest is there with its size and CRC-32, else
    what is wrong (the first problem found). A checkpoint without a manifest (written by
    an older version) is accepted."""
    path = os.path.join(ckpt_dir, _MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {_MANIFEST}: {type(e).__name__}: {e}"
    for rel, meta in files.items():
        full = os.path.join(ckpt_dir, rel)
        if not os.path.exists(full):
            return f"{rel} is missing"
        size = os.path.getsize(full)
        if size != meta["size"]:
            return f"{rel} has {size} bytes, the manifest says {meta['size']} (truncated?)"
        if _crc32(full) != meta["crc32"]:
            return f"{rel}: CRC-32 differs from the manifest (corrupted)"
    return None


@dataclass
class RecoverInfo:
    last_step_info: StepInfo
    saver_info: dict = field(default_factory=dict)
    evaluator_info: dict = field(default_factory=dict)
    dataloader_info: dict = field(default_factory=dict)
    rng_state: dict = field(default_factory=dict)
    inference_version: int = 0
    extra: dict = field(default_factory=dict)


def recover_root(config: Any) -> str:
    return os.path.join(
        str(config.fileroot),
        "checkpoints",
        str(config.experiment_name),
        str(config.trial_name),
        "recover",
    )


def get_rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict) -> None:
    if not state:
        return
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def checkpoint_step(ckpt_dir: str) -> int:
    """The global step of a checkpoint directory ``.../step{N:08d}``."""
    return int(os.path.basename(ckpt_dir.rstrip("/"))[len("step") :])


def list_complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories, oldest first."""
    dirs = [
        d
        for d in glob.glob(os.path.join(root, "step*"))
        if os.path.exists(os.path.join(d, _MARKER))
    ]
    return sorted(dirs)


class RecoverHandler:
    def __init__(self, config: RecoverConfig, ft_spec: FinetuneSpec):
        self.config = config
        self.ft_spec = ft_spec
        self.root = recover_root(config)
        self.keep_last = KEEP_LAST
        self.freq_ctl = EpochStepTimeFreqCtl(
            freq_epoch=config.freq_epochs, freq_step=config.freq_steps, freq_sec=config.freq_secs
        )
        # (engine, tmp dir, final dir, global step, start time) of a background write
        self._pending: tuple[Any, str, str, int, float] | None = None

    @property
    def enabled(self) -> bool:
        return self.config.mode != "disabled"

    @property
    def resumes(self) -> bool:
        return self.config.mode in ("on", "auto")

    # ------------------------------------------------------------------ dump
    def dump(
        self,
        engine: Any,
        step_info: StepInfo,
        saver: Any,
        evaluator: Any,
        stats_logger: Any,
        dataloader: Any,
        inference_engine: Any = None,
        tokenizer: Any = None,
        force: bool = False,
    ) -> str | None:
        """Write a recover checkpoint when due (or ``force``); returns its directory."""
        if not self.enabled:
            return None
        epoch_done = int(step_info.epoch_step + 1 == step_info.steps_per_epoch)
        last = step_info.global_step + 1 >= self.ft_spec.total_train_steps
        if not (self.freq_ctl.check(epochs=epoch_done, steps=1) or force or last):
            return None
        self.wait_pending()  # a new checkpoint waits for the previous background write
        t0 = time.monotonic()
        os.makedirs(self.root, exist_ok=True)
        final = os.path.join(self.root, f"step{step_info.global_step:08d}")
        tmp = os.path.join(self.root, f".tmp-step{step_info.global_step:08d}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        background = engine.save(
            SaveLoadMeta(
                path=os.path.join(tmp, "model"),
                weight_format="dcp",
                with_optim=not self.config.no_save_optim,
                tokenizer=tokenizer,
                save_mode=self.config.save_mode,
            )
        )
        version = (
            inference_engine.get_version()
            if inference_engine is not None
            else step_info.global_step + 1
        )
        executor = getattr(inference_engine, "workflow_executor", None)
        # Rows drawn from the dataloader but not yet trained on: re-run after a resume.
        pending = executor.pending_data() if executor is not None else []
        info = RecoverInfo(
            last_step_info=step_info,
            saver_info=saver.state_dict() if saver is not None else {},
            evaluator_info=evaluator.state_dict() if evaluator is not None else {},
            dataloader_info=dataloader.state_dict() if dataloader is not None else {},
            rng_state=get_rng_state(),
            inference_version=int(version),
            extra={"pending_data": pending},
        )
        torch.save(info, os.path.join(tmp, _INFO))
        if background is True:
            self._pending = (engine, tmp, final, step_info.global_step, t0)
            logger.info(
                f"Recover checkpoint for step {step_info.global_step} staged in "
                f"{time.monotonic() - t0:.2f}s; writing in the background"
            )
            return final
        self._complete(tmp, final, step_info.global_step)
        logger.info(
            f"Recover checkpoint for step {step_info.global_step} written in {time.monotonic() - t0:.2f}s"
        )
        return final

    def _complete(self, tmp: str, final: str, global_step: int) -> None:
        """Manifest, marker, rename into place, prune: from here ``final`` is valid."""
        write_manifest(tmp)
        with open(os.path.join(tmp, _MARKER), "w") as f:
            f.write(f"{global_step}\n")
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()

    @property
    def pending(self) -> bool:
        """Whether a background checkpoint write has not been completed yet."""
        return self._pending is not None

    def wait_pending(self) -> str | None:
        """Finish the pending background write (if any): wait for the engine's write,
        then manifest, marker and rename. Returns the completed directory. When the write
        failed, its temporary directory is removed (the previous checkpoint stays the
        newest complete one) and the error is raised."""
        if self._pending is None:
            return None
        engine, tmp, final, global_step, t0 = self._pending
        self._pending = None
        try:
            engine.wait_async_save()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._complete(tmp, final, global_step)
        logger.info(
            f"Recover checkpoint for step {global_step} complete "
            f"{time.monotonic() - t0:.2f}s after it was staged"
        )
        return final

    def close(self) -> None:
        """Shutdown: wait for a pending background write and complete its checkpoint."""
        if self._pending is not None:
            logger.info(
                f"Waiting for the background write of the recover checkpoint of step "
                f"{self._pending[3]} before shutting down"
            )
            self.wait_pending()

    def _prune(self) -> None:
        complete = list_complete_checkpoints(self.root)
        for d in complete[: -self.keep_last]:
            shutil.rmtree(d, ignore_errors=True)
        for d in glob.glob(os.path.join(self.root, ".tmp-*")):
            pid = d.rsplit("-", 1)[-1]
            if pid != str(os.getpid()):  # left behind by a killed process
                shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def latest(self) -> str | None:
        """The newest complete checkpoint whose files match its manifest; a damaged one is
        logged (which file, what) and skipped in favour of the previous one."""
        for d in reversed(list_complete_checkpoints(self.root)):
            problem = verify_checkpoint(d)
            if problem is None:
                return d
            logger.error(
                f"Recover checkpoint {d} is damaged although marked complete: {problem}; "
                "using the previous one"
            )
        return None

    def load(
        self,
        engine: Any,
        saver: Any,
        evaluator: Any,
        stats_logger: Any,
        dataloader: Any,
        inference_engine: Any = None,
        weight_sync: Any = None,
    ) -> RecoverInfo | None:
        """Restore the newest complete checkpoint (modes on/auto); ``None`` when starting fresh.

        ``weight_sync`` (an ``areal.infra.weight_sync.WeightSynchronizer`` over ``engine``
        and ``inference_engine``) pushes the restored weights to the servers and sets the
        recovered version on every side before any rollout; without it only ``engine``
        and ``inference_engine`` get the version (no servers to update).
        """
        if not self.resumes:
            return None
        self.wait_pending()
        path = self.latest()
        if path is None:
            logger.info(f"No recover checkpoint under {self.root}; starting fresh")
            return None
        logger.info(f"Resuming from {path}")
        return self.restore(
            path,
            engine,
            saver,
            evaluator,
            stats_logger,
            dataloader,
            inference_engine=inference_engine,
            weight_sync=weight_sync,
        )

    def latest_before(self, step: int, skip: Any = None) -> str | None:
        """The newest complete, verified checkpoint of a step before ``step`` (a damaged
        one is logged and skipped, and so is one whose step ``skip(step)`` refuses); None
        when there is none (run health's rollback). A pending background write is
        completed first, so its checkpoint is a candidate too."""
        self.wait_pending()
        for d in reversed(list_complete_checkpoints(self.root)):
            if checkpoint_step(d) >= step or (skip is not None and skip(checkpoint_step(d))):
                continue
            problem = verify_checkpoint(d)
            if problem is None:
                return d
            logger.error(f"Recover checkpoint {d} is damaged: {problem}; trying an older one")
        return None

    def restore(
        self,
        path: str,
        engine: Any,
        saver: Any,
        evaluator: Any,
        stats_logger: Any,
        dataloader: Any,
        inference_engine: Any = None,
        weight_sync: Any = None,
        reason: str = "recover",
    ) -> RecoverInfo:
        """Restore the checkpoint at ``path`` (whatever ``mode`` says; ``load`` picks the
        newest): model + optimizer, saver/evaluator/dataloader state, RNG, stats files cut
        after its step, the servers' weights and version, the rows it had in flight."""
        self.wait_pending()  # never load while a background write still runs
        info: RecoverInfo = torch.load(os.path.join(path, _INFO), weights_only=False)
        engine.load(
            SaveLoadMeta(
                path=os.path.join(path, "model"),
                weight_format="dcp",
                with_optim=not self.config.no_load_optim,
            )
        )
        if saver is not None and info.saver_info:
            saver.load_state_dict(info.saver_info)
        if evaluator is not None and info.evaluator_info:
            evaluator.load_state_dict(info.evaluator_info)
        if stats_logger is not None:
            stats_logger.truncate_after(info.last_step_info.global_step)
            _truncate_jsonl(
                os.path.join(stats_logger.log_path, "consumed.jsonl"),
                info.last_step_info.global_step,
            )
        if dataloader is not None and info.dataloader_info:
            dataloader.load_state_dict(info.dataloader_info)
        set_rng_state(info.rng_state)
        version = info.inference_version
        # The servers still hold the initial weights: push the restored ones before any rollout.
        if weight_sync is not None:
            weight_sync.sync(version, resume=True, reason=reason)
        else:
            engine.set_version(version)
            if inference_engine is not None:
                inference_engine.set_version(version)
        if inference_engine is not None:
            executor = getattr(inference_engine, "workflow_executor", None)
            sm = getattr(executor, "staleness_manager", None)
            if sm is not None:
                sm.on_version_recovered(version)
            rebase = getattr(executor, "rebase_deterministic", None)
            if callable(rebase):  # deterministic rollout: batch `version` comes next
                rebase(version)
            pending = info.extra.get("pending_data", [])
            if executor is not None and pending:
                executor.requeue_data(pending)
                logger.info(
                    f"Re-queued {len(pending)} rows that were in flight when the checkpoint was taken"
                )
        return info


def _truncate_jsonl(path: str, global_step: int) -> None:
    """Drop rows of ``path`` whose ``global_step`` is later than ``global_step``."""
    import json

    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in rows if r.get("global_step", -1) <= global_step]
    if len(kept) != len(rows):
        with open(path, "w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
