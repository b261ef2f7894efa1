"""Child process of ``tests/test_async_checkpoint.py``: a real FSDP engine (one gloo rank)
with a ``RecoverHandler`` in ``save_mode='async'``.

``train MODEL ROOT OUT``: first the same state saved synchronously and asynchronously
(training going on during the background write), both loaded back (``OUT/equiv.pt``);
then steps 0, 1, ... each followed by a recover dump; after step 0's
dump saves the parameters as they were at that dump (``OUT/p0.pt``); after step 1's dump
(whose write is pending) prints ``PENDING <tmp dir>`` and keeps training until killed.
``resume MODEL ROOT OUT``: a fresh engine resumes; writes the step and parameters to
``OUT/resumed.pt``.
"""

from __future__ import annotations

import glob
import os
import sys
import time

import torch
from test_fsdp_engine import full_params, loss_fn, loss_weight_fn, make_batch, make_engine

from areal.api.cli_args import RecoverConfig
from areal.api.io_struct import FinetuneSpec, SaveLoadMeta, StepInfo
from areal.utils.recover import RecoverHandler

FT = FinetuneSpec(total_train_epochs=1, dataset_size=1000, train_batch_size=10)


def equivalence(eng, out: str) -> dict:
    """Save one state sync and async, keep training during the background write, load
    both back; what the test compares."""
    eng.train_batch(make_batch(0), loss_fn, loss_weight_fn)
    p1 = full_params(eng)
    sync_dir, async_dir = os.path.join(out, "sync"), os.path.join(out, "async")
    res = {"sync": eng.save(SaveLoadMeta(sync_dir, "dcp", with_optim=True))}
    res["async"] = eng.save(SaveLoadMeta(async_dir, "dcp", with_optim=True, save_mode="async"))
    res["pending"] = eng.has_pending_save()
    # training goes on: the staged copy, not the live parameters, is written
    eng.train_batch(make_batch(1), loss_fn, loss_weight_fn)
    res["moved"] = any(not torch.equal(p1[k], v) for k, v in full_params(eng).items())
    res["waited"] = eng.wait_async_save()
    res["files"] = {d: sorted(os.listdir(p)) for d, p in (("s", sync_dir), ("a", async_dir))}
    res["auto_tiny"] = eng.save(SaveLoadMeta(os.path.join(out, "auto"), "dcp", save_mode="auto"))
    for name, d in (("sync", sync_dir), ("async", async_dir)):
        eng.load(SaveLoadMeta(d, "dcp", with_optim=True))
        res[f"same_{name}"] = all(torch.equal(p1[k], v) for k, v in full_params(eng).items())
        # the optimizer state came back too: the next step is the same from both
        eng.train_batch(make_batch(1), loss_fn, loss_weight_fn)
        res[f"next_{name}"] = full_params(eng)
    return res


def main(cmd: str, model: str, root: str, out: str) -> None:
    torch.set_num_threads(1)
    cfg = RecoverConfig(
        experiment_name="e", trial_name="t", fileroot=root, mode="on", freq_steps=1,
        save_mode="async",
    )  # fmt: skip
    eng = make_engine(model, total_steps=100)
    handler = RecoverHandler(cfg, FT)
    if cmd == "resume":
        info = handler.load(eng, None, None, None, None)
        torch.save(
            {"step": info.last_step_info.global_step, "params": full_params(eng)},
            os.path.join(out, "resumed.pt"),
        )
        return
    torch.save(equivalence(eng, out), os.path.join(out, "equiv.pt"))
    for step in range(100):
        eng.train_batch(make_batch(step), loss_fn, loss_weight_fn)
        eng.step_lr_scheduler()
        handler.dump(eng, StepInfo(0, step, step, FT.steps_per_epoch), None, None, None, None)
        if step == 0:
            torch.save(full_params(eng), os.path.join(out, "p0.pt"))
        if step == 1:
            assert handler.pending
            (tmp,) = glob.glob(os.path.join(handler.root, ".tmp-*"))
            print(f"PENDING {tmp}", flush=True)
            while True:  # training goes on while the write is in the background
                eng.train_batch(make_batch(99), loss_fn, loss_weight_fn)
                time.sleep(0.05)


if __name__ == "__main__":
    main(*sys.argv[1:])
