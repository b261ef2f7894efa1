"""The ``xccl`` weight update across real processes.

- The demo controller (``examples/math/gsm8k_rl.py``) trains 2 synchronous steps with
  ``actor.weight_update_mode=xccl``: training rank 0 broadcasts to the built-in server
  over gloo, and the server's logprobs under the broadcast weights equal the trainer's.
- A failure on the inference side is raised by the controller at once with a clear
  error, and training rank 0 gives up on its broadcast within the configured timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "math", "gsm8k_rl.py")
DEMO_YAML = os.path.join(REPO, "examples", "math", "gsm8k_grpo_cpu.yaml")


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_gsm8k_demo_xccl_two_steps_server_logprobs_match_trainer(tiny_lm_dir, tmp_path):
    fileroot = str(tmp_path / "out")
    cmd = [
        sys.executable, SCRIPT, "--config", DEMO_YAML,
        f"actor.path={tiny_lm_dir}",
        f"cluster.fileroot={fileroot}",
        "total_train_steps=2",
        "train_dataset.path=synthetic://arith?n=200",
        "valid_dataset=null",
        "train_dataset.batch_size=4",
        "gconfig.n_samples=4",
        "gconfig.max_new_tokens=12",
        "actor.dynamic_sampling=false",
        "recover.mode=disabled",
        "actor.weight_update_mode=xccl",
        "actor.weight_update_timeout=30",  # a broken sync fails in 30 s instead of hanging
        "rollout.max_head_offpolicyness=0",  # every token is of the current version
    ]  # fmt: skip
    log = str(tmp_path / "run.log")
    seen: dict[int, psutil.Process] = {}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 480
        while proc.poll() is None:
            assert time.monotonic() < deadline, "demo did not finish in 480 s"
            try:
                for c in psutil.Process(proc.pid).children(recursive=True):
                    seen.setdefault(c.pid, c)
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    text = open(log).read()
    assert proc.returncode == 0, text[-4000:]
    # Every worker and server the controller started is gone.
    _, alive = psutil.wait_procs(list(seen.values()), timeout=30)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]

    log_dir = os.path.join(fileroot, "logs", "gsm8k-grpo-cpu", "demo")
    assert "joined weight-update group" in open(os.path.join(log_dir, "actor-0.log")).read()
    rows = _rows(os.path.join(log_dir, "stats.jsonl"))
    assert [r["global_step"] for r in rows] == [0, 1]
    for r in rows:
        if r["consistency/fresh_tokens"] > 0:
            assert r["consistency/logp_absdiff_max"] < 1e-3, r
    # Step 1 was generated entirely by the server after the first broadcast (version 1):
    # its logprobs match the trainer's only if every tensor arrived intact.
    assert rows[1]["consistency/fresh_tokens"] > 0, rows[1]


class _RejectingInferenceEngine:
    """Controller-side inference engine whose one "server" (group rank 1, a thread of
    this process) joins the weight-update group but rejects every announcement."""

    def __init__(self):
        self.calls: list[str] = []
        self._paused = False
        self.pg = None

    def init_weights_update_group(self, meta):
        from areal.infra.daemon_threads import spawn_daemon
        from areal.utils.dist import init_custom_process_group

        meta.world_size = 2
        self.calls.append("init")

        def _join():
            # Keep the group alive: dropping it would close the connections at once.
            self.pg = init_custom_process_group(
                "gloo", meta.master_address, meta.master_port, 2, 1, meta.group_name, meta.timeout_s
            )

        return spawn_daemon(_join)

    def update_weights_from_distributed(self, meta, specs):
        self.calls.append(f"announce:{len(specs)}")
        fut: Future = Future()
        fut.set_exception(RuntimeError("HTTP 400 from fake:1: unknown dtype 'float33'"))
        return fut

    def is_paused(self) -> bool:
        return self._paused

    def pause_generation(self) -> None:
        self.calls.append("pause")
        self._paused = True

    def continue_generation(self) -> None:
        self.calls.append("continue")
        self._paused = False


@pytest.mark.slow
def test_xccl_server_rejects_announcement_raises_fast_and_trainer_recovers(
    tiny_model_dir, tmp_path
):
    from _train_config import tiny_train_config

    from areal.api.io_struct import FinetuneSpec, WeightUpdateMeta
    from areal.infra.controller.train_controller import TrainController
    from areal.infra.scheduler.local import LocalScheduler
    from areal.utils.network import find_free_ports

    config = tiny_train_config(tiny_model_dir)
    ft_spec = FinetuneSpec(total_train_epochs=1, dataset_size=10, train_batch_size=1)
    timeout_s = 8.0
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=180, call_timeout=120) as sched:
        c = TrainController("areal.engine.fsdp_engine.FSDPEngine", config, sched)
        try:
            c.initialize("actor", world_size=1, ft_spec=ft_spec)
            engine = _RejectingInferenceEngine()
            meta = WeightUpdateMeta.from_fsdp_xccl(
                master_port=find_free_ports(1)[0], timeout_s=timeout_s
            )
            c.connect_engine(engine, meta)  # both sides join here, concurrently
            assert meta.world_size == 2 and engine.calls == ["init"]

            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=r"receiving bucket 1/1 .*float33"):
                c.update_weights(meta.with_version(1))
            assert time.monotonic() - t0 < timeout_s  # not after rank 0's broadcast gives up
            # the controller only announces: pausing belongs to WeightSynchronizer
            assert "pause" not in engine.calls and "continue" not in engine.calls
            assert len(engine.calls) == 2 and engine.calls[1].startswith("announce:")

            # Training rank 0 is released within timeout_s (its RPC thread serves calls in
            # order, so this call waits for the abandoned broadcast to give up).
            t0 = time.monotonic()
            assert c.get_version() == 0
            assert time.monotonic() - t0 < timeout_s + 20
        finally:
            c.destroy()
