"""Chaos soak: the CPU demo for N minutes with faults injected on a schedule. Prints JSON.

    .venv/bin/python benchmarks/chaos_soak.py --minutes 20 [--fault-every 45 --seed 0]

The controller (``benchmarks/chaos/chaos_controller.py``: the demo with two built-in
servers, ``recover.mode=auto`` every step, a reward that can be made to hang) runs in its
own process group. Every ``--fault-every`` seconds one fault is injected, cycling through
the types in a seeded random order:

- ``server_kill9``: SIGKILL one inference server (the watchdog restarts it);
- ``server_sigstop``: SIGSTOP one server for ``--stop-seconds``, then SIGCONT (hung);
- ``controller_kill9``: SIGKILL the controller, wait for its children, rerun the command
  (resumes from the last recover checkpoint);
- ``truncated_checkpoint``: SIGKILL the controller, truncate a file of the newest recover
  checkpoint (its COMPLETE marker stays), rerun (must fall back to the previous one);
- ``reward_hang``: every reward call hangs for ``--hang-seconds`` (longer than the
  reward timeout: the wrapper must kill it and count 0).

A fault is *survived* when a new training step completes within ``--survive-seconds``
after it. At the end the controller gets SIGTERM (graceful stop at a step boundary).
From ``consumed.jsonl``: ``samples_consumed_twice`` (a prompt trained on more than its
``n_samples`` times in an epoch, or a step logged twice) and ``samples_lost`` (prompts of
completed epochs never trained on; a gap in the step numbers). ``longest_stall_s``: the
longest wall-clock gap between two completed steps (restarts included).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTROLLER = os.path.join(REPO, "benchmarks", "chaos", "chaos_controller.py")
DEMO_YAML = os.path.join(REPO, "examples", "math", "gsm8k_grpo_cpu.yaml")
FAULTS = (
    "server_kill9",
    "server_sigstop",
    "controller_kill9",
    "truncated_checkpoint",
    "reward_hang",
)
N_ROWS, BATCH, N_SAMPLES = 64, 4, 4


def _cmd(fileroot: str) -> list[str]:
    return [
        sys.executable, CONTROLLER, "--config", DEMO_YAML,
        f"cluster.fileroot={fileroot}",
        "allocation_mode=local:d2+fsdp:d1",
        "total_train_epochs=1000",
        "total_train_steps=100000",
        f"train_dataset.path=synthetic://arith?digits=3&steps=2&n={N_ROWS}&seed=11",
        f"train_dataset.batch_size={BATCH}",
        f"gconfig.n_samples={N_SAMPLES}",
        "gconfig.max_new_tokens=16",
        "actor.dynamic_sampling=false",
        "valid_dataset=null",
        "recover.mode=auto",
        "recover.freq_steps=1",
        "recover.retries=0",
        "rollout.request_timeout=60",
    ]  # fmt: skip


class Soak:
    def __init__(self, args):
        self.args = args
        self.root = args.workdir or tempfile.mkdtemp(prefix="areal-chaos-")
        self.chaos_dir = os.path.join(self.root, "chaos")
        os.makedirs(self.chaos_dir, exist_ok=True)
        self.log_dir = os.path.join(self.root, "logs", "gsm8k-grpo-cpu", "demo")
        self.ckpt_root = os.path.join(self.root, "checkpoints", "gsm8k-grpo-cpu", "demo", "recover")
        self.proc: subprocess.Popen | None = None
        self.launches = 0
        self.step_times: list[float] = []  # wall time at which each new step was seen
        self.last_steps = -1
        self.injected = collections.Counter()
        self.survived = collections.Counter()
        self.pending: list[tuple[str, float, int]] = []  # fault, time, steps at injection
        self.server_restarts_seen = 0
        self.stopped: list[psutil.Process] = []
        self.stopping = False
        self.unexpected_exits = 0

    # ------------------------------------------------------------------ processes
    def launch(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", AREAL_CHAOS_DIR=self.chaos_dir)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [REPO, os.path.dirname(CONTROLLER), env.get("PYTHONPATH")])
        )
        self.launches += 1
        log = open(os.path.join(self.root, f"controller-{self.launches}.log"), "w")
        self.proc = subprocess.Popen(
            _cmd(self.root), stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
            start_new_session=True,
        )  # fmt: skip

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def servers(self) -> list[psutil.Process]:
        out = []
        for c in self.children():
            try:
                if "areal.engine.local_server" in " ".join(c.cmdline()):
                    out.append(c)
            except psutil.Error:
                pass
        return out

    def kill_controller(self) -> None:
        kids = self.children()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        for p in self.stopped:
            try:
                p.resume()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(kids, timeout=60)
        for p in alive:  # should not happen: workers exit with their parent
            p.kill()

    # ------------------------------------------------------------------ progress
    def steps(self) -> int:
        path = os.path.join(self.log_dir, "stats.jsonl")
        if not os.path.exists(path):
            return 0
        with open(path) as f:
            return sum(1 for line in f if line.strip())

    def poll(self) -> None:
        n = self.steps()
        now = time.monotonic()
        if n > self.last_steps:
            if self.last_steps >= 0:
                self.step_times.append(now)
            self.last_steps = n
            for fault, t, n0 in list(self.pending):
                if n > n0:
                    self.survived[fault] += 1
                    self.pending.remove((fault, t, n0))
        for fault, t, n0 in list(self.pending):
            if now - t > self.args.survive_seconds:
                self.pending.remove((fault, t, n0))
        if self.proc.poll() is not None and not self.stopping:  # a crash we did not cause
            self.unexpected_exits += 1
            self.launch()

    # ------------------------------------------------------------------ faults
    def inject(self, fault: str) -> bool:
        n0 = self.steps()
        if fault == "server_kill9":
            servers = self.servers()
            if not servers:
                return False
            random.choice(servers).kill()
        elif fault == "server_sigstop":
            servers = self.servers()
            if not servers:
                return False
            victim = random.choice(servers)
            victim.suspend()
            self.stopped.append(victim)
            t_end = time.monotonic() + self.args.stop_seconds
            while time.monotonic() < t_end:
                self.poll()
                time.sleep(0.5)
            try:
                victim.resume()
            except psutil.Error:
                pass
            self.stopped.remove(victim)
        elif fault in ("controller_kill9", "truncated_checkpoint"):
            self.kill_controller()
            if fault == "truncated_checkpoint":
                ckpts = sorted(
                    d
                    for d in os.listdir(self.ckpt_root)
                    if d.startswith("step") and os.path.exists(os.path.join(self.ckpt_root, d, "COMPLETE"))
                ) if os.path.isdir(self.ckpt_root) else []  # fmt: skip
                if len(ckpts) < 2:
                    self.launch()
                    return False
                newest = os.path.join(self.ckpt_root, ckpts[-1])
                victim = os.path.join(newest, "recover_info.pt")
                with open(victim, "r+b") as f:
                    f.truncate(os.path.getsize(victim) // 2)
            self.launch()
        elif fault == "reward_hang":
            marker = os.path.join(self.chaos_dir, "reward_hang")
            open(marker, "w").close()
            t_end = time.monotonic() + self.args.hang_seconds
            while time.monotonic() < t_end:
                self.poll()
                time.sleep(0.5)
            os.remove(marker)
        self.injected[fault] += 1
        self.pending.append((fault, time.monotonic(), n0))
        return True

    # ------------------------------------------------------------------ audit
    def audit(self) -> dict:
        path = os.path.join(self.log_dir, "consumed.jsonl")
        rows = []
        if os.path.exists(path):
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        steps = [r["global_step"] for r in rows]
        dup_steps = len(steps) - len(set(steps))
        gaps = sum(1 for a, b in zip(sorted(set(steps)), sorted(set(steps))[1:]) if b != a + 1)
        steps_per_epoch = N_ROWS // BATCH
        by_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        for r in rows:
            by_epoch[r["global_step"] // steps_per_epoch].update(r["prompts"])
        twice = sum(max(0, c - N_SAMPLES) for cnt in by_epoch.values() for c in cnt.values())
        twice += dup_steps * BATCH * N_SAMPLES
        complete = [
            e
            for e in by_epoch
            if sum(1 for s in set(steps) if s // steps_per_epoch == e) == steps_per_epoch
        ]
        lost = sum(max(0, N_ROWS - len(by_epoch[e])) * N_SAMPLES for e in complete)
        lost += gaps * BATCH * N_SAMPLES
        return {
            "samples_trained": sum(len(r["prompts"]) for r in rows),
            "samples_lost": lost,
            "samples_consumed_twice": twice,
            "epochs_completed": len(complete),
        }

    def run(self) -> dict:
        args = self.args
        t0 = time.monotonic()
        deadline = t0 + args.minutes * 60
        order: list[str] = []
        self.launch()
        while self.steps() < 1 and time.monotonic() < deadline:  # first step: the set-up
            self.poll()
            time.sleep(0.5)
        self.poll()
        next_fault = time.monotonic() + args.fault_every
        while time.monotonic() < deadline:
            self.poll()
            if time.monotonic() >= next_fault:
                if not order:
                    order = random.sample(FAULTS, len(FAULTS))
                self.inject(order.pop())
                next_fault = time.monotonic() + args.fault_every
            time.sleep(0.5)
        # graceful stop: SIGTERM finishes the step and writes a checkpoint
        wait_end = time.monotonic() + args.survive_seconds
        while self.pending and time.monotonic() < wait_end:
            self.poll()
            time.sleep(0.5)
        self.stopping = True
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = None
        self.poll()
        gaps = [b - a for a, b in zip(self.step_times, self.step_times[1:])]
        restarts = 0
        stats_path = os.path.join(self.log_dir, "stats.jsonl")
        if os.path.exists(stats_path):
            with open(stats_path) as f:
                restarts = int(
                    sum(json.loads(line).get("rollout/server_restarts", 0) for line in f if line.strip())
                )  # fmt: skip
        out = {
            "minutes": round((time.monotonic() - t0) / 60, 2),
            "steps_completed": self.steps(),
            "faults_injected": dict(self.injected),
            "faults_survived": dict(self.survived),
            "controller_launches": self.launches,
            "controller_exits_not_injected": self.unexpected_exits,
            "server_restarts": restarts,
            "longest_stall_s": round(max(gaps, default=0.0), 1),
            "median_step_s": round(sorted(gaps)[len(gaps) // 2], 1) if gaps else None,
            "final_exit_code": rc,
            "workdir": self.root,
        }
        out.update(self.audit())
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--fault-every", type=float, default=45.0)
    ap.add_argument("--stop-seconds", type=float, default=20.0)
    ap.add_argument("--hang-seconds", type=float, default=25.0)
    ap.add_argument("--survive-seconds", type=float, default=180.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    random.seed(args.seed)
    soak = Soak(args)
    try:
        print(json.dumps(soak.run(), indent=2))
    finally:
        if soak.proc is not None and soak.proc.poll() is None:
            os.killpg(soak.proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
