"""RecoverHandler: atomic checkpoints, keep-last-K, modes, and what a resume restores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch

from areal.api.cli_args import RecoverConfig
from areal.api.io_struct import FinetuneSpec, StepInfo
from areal.utils.recover import RecoverHandler, list_complete_checkpoints, verify_checkpoint


class FakeEngine:
    """Writes/reads one tensor file per save; records calls."""

    def __init__(self):
        self.saved, self.loaded, self.versions, self.pushed = [], [], [], []
        self.w = torch.zeros(3)

    def save(self, meta):
        os.makedirs(meta.path, exist_ok=True)
        torch.save(self.w, os.path.join(meta.path, "w.pt"))
        self.saved.append(meta)

    def load(self, meta):
        self.w = torch.load(os.path.join(meta.path, "w.pt"))
        self.loaded.append(meta)

    def set_version(self, v):
        self.versions.append(v)

    def update_weights(self, meta):
        self.pushed.append(meta)


class FakeExecutor:
    def __init__(self, pending):
        self._pending = pending
        self.requeued = []
        self.recovered_version = None
        self.staleness_manager = self

    def pending_data(self):
        return list(self._pending)

    def requeue_data(self, items):
        self.requeued.extend(items)

    def on_version_recovered(self, v):
        self.recovered_version = v


class FakeInference:
    def __init__(self, pending=()):
        self.version = 0
        self.workflow_executor = FakeExecutor(pending)
        self.paused = 0
        self.resumed = 0
        self.pushed = []

    def get_version(self):
        return self.version

    def set_version(self, v):
        self.version = v

    def update_weights_from_disk(self, meta):  # the servers load as pending ...
        self.pushed.append(meta)

    def commit_weights(self, v):  # ... and the version moves at the commit
        self.version = v

    def pause(self):
        self.paused += 1

    def resume(self):
        self.resumed += 1


class FakeDataloader:
    def __init__(self):
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, s):
        self.pos = s["pos"]


def _cfg(root, mode="auto"):
    return RecoverConfig(
        experiment_name="e", trial_name="t", fileroot=str(root), mode=mode, freq_steps=1
    )


FT = FinetuneSpec(total_train_epochs=1, dataset_size=100, train_batch_size=10)


def _dump(handler, engine, step, inf=None, dl=None):
    return handler.dump(
        engine,
        StepInfo(0, step, step, FT.steps_per_epoch),
        None,
        None,
        None,
        dl,
        inference_engine=inf,
    )


def test_recover_dump_then_load_restores_step_weights_dataloader_and_pending(tmp_path):
    h = RecoverHandler(_cfg(tmp_path), FT)
    eng, dl, inf = FakeEngine(), FakeDataloader(), FakeInference(pending=[{"q": 1}, {"q": 2}])
    eng.w = torch.tensor([1.0, 2.0, 3.0])
    dl.pos = 7
    inf.version = 4
    _dump(h, eng, 3, inf, dl)

    eng2, dl2, inf2 = FakeEngine(), FakeDataloader(), FakeInference()
    from areal.api.io_struct import WeightUpdateMeta
    from areal.infra.weight_sync import WeightSynchronizer

    meta = WeightUpdateMeta.from_disk("e", "t", str(tmp_path))
    sync = WeightSynchronizer(eng2, inf2, meta)
    info = RecoverHandler(_cfg(tmp_path), FT).load(
        eng2, None, None, None, dl2, inference_engine=inf2, weight_sync=sync
    )
    assert info.last_step_info.global_step == 3
    assert torch.equal(eng2.w, torch.tensor([1.0, 2.0, 3.0]))
    assert dl2.pos == 7
    assert inf2.version == 4 and eng2.versions == [4]
    # restored weights exported and pushed before any rollout
    assert [m.version for m in inf2.pushed] == [4]
    assert [m.path for m in eng2.saved] == [inf2.pushed[0].path]
    assert inf2.paused == 1 and inf2.resumed == 1  # through the one weight-sync object
    assert inf2.workflow_executor.requeued == [{"q": 1}, {"q": 2}]
    assert inf2.workflow_executor.recovered_version == 4


def test_recover_keeps_only_last_two_complete_checkpoints(tmp_path):
    h = RecoverHandler(_cfg(tmp_path), FT)
    eng = FakeEngine()
    for s in range(4):
        _dump(h, eng, s)
    names = [os.path.basename(d) for d in list_complete_checkpoints(h.root)]
    assert names == ["step00000002", "step00000003"]


def test_recover_mode_off_writes_but_never_resumes(tmp_path):
    h = RecoverHandler(_cfg(tmp_path, "off"), FT)
    assert _dump(h, FakeEngine(), 0) is not None
    assert h.load(FakeEngine(), None, None, None, None) is None


def test_recover_mode_disabled_writes_nothing(tmp_path):
    h = RecoverHandler(_cfg(tmp_path, "disabled"), FT)
    assert _dump(h, FakeEngine(), 0) is None
    assert not os.path.exists(h.root)


def test_recover_kill_during_checkpoint_write_leaves_previous_checkpoint_usable(tmp_path):
    """A process SIGKILLed while writing step 1 leaves step 0 as the newest usable checkpoint."""
    script = tmp_path / "dump_and_die.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal, sys
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            import torch
            from test_recover import FakeEngine, _cfg, _dump, FT
            from areal.utils.recover import RecoverHandler

            class DyingEngine(FakeEngine):
                def save(self, meta):
                    super().save(meta)
                    if len(self.saved) == 2:  # half-way through the second checkpoint
                        os.kill(os.getpid(), signal.SIGKILL)

            h = RecoverHandler(_cfg({str(tmp_path)!r}), FT)
            e = DyingEngine()
            e.w = torch.tensor([0.0, 0.0, 1.0])
            _dump(h, e, 0)
            e.w = torch.tensor([9.0, 9.0, 9.0])
            _dump(h, e, 1)
            """
        )
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    h = RecoverHandler(_cfg(tmp_path), FT)
    leftovers = [d for d in os.listdir(h.root) if d.startswith(".tmp-")]
    assert leftovers, "the killed write should have left a temporary directory"
    eng = FakeEngine()
    info = h.load(eng, None, None, None, None)
    assert info.last_step_info.global_step == 0
    assert torch.equal(eng.w, torch.tensor([0.0, 0.0, 1.0]))
    # The next successful dump cleans the half-written directory up.
    _dump(h, FakeEngine(), 1)
    assert not [d for d in os.listdir(h.root) if d.startswith(".tmp-")]


def test_recover_truncated_file_with_marker_detected_previous_checkpoint_used(tmp_path, caplog):
    """Step 1's weights file is cut short after the COMPLETE marker was written (a full
    disk, a copy cut short): its manifest catches it and step 0 is resumed from."""
    h = RecoverHandler(_cfg(tmp_path), FT)
    eng = FakeEngine()
    eng.w = torch.tensor([1.0, 2.0, 3.0])
    step0 = _dump(h, eng, 0)
    eng.w = torch.tensor([9.0, 9.0, 9.0])
    step1 = _dump(h, eng, 1)
    assert verify_checkpoint(step0) is None and verify_checkpoint(step1) is None
    assert os.path.exists(os.path.join(step1, "COMPLETE"))
    victim = next(
        os.path.join(d, n) for d, _, ns in os.walk(os.path.join(step1, "model")) for n in ns
    )
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    problem = verify_checkpoint(step1)
    assert problem is not None and "truncated" in problem and os.path.basename(victim) in problem

    eng2 = FakeEngine()
    with caplog.at_level("ERROR"):
        info = RecoverHandler(_cfg(tmp_path), FT).load(eng2, None, None, None, None)
    assert info.last_step_info.global_step == 0
    assert torch.equal(eng2.w, torch.tensor([1.0, 2.0, 3.0]))
    assert "damaged although marked complete" in caplog.text and "step00000001" in caplog.text


def test_recover_corrupted_same_size_file_detected_by_checksum(tmp_path):
    h = RecoverHandler(_cfg(tmp_path), FT)
    d = _dump(h, FakeEngine(), 0)
    info = os.path.join(d, "recover_info.pt")
    with open(info, "r+b") as f:
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 0xFF]))
    assert "CRC-32" in verify_checkpoint(d)
    assert h.latest() is None
