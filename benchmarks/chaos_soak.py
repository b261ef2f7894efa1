"""Chaos soak: the CPU demo for N minutes with faults injected on a schedule. Prints JSON.

    .venv/bin/python benchmarks/chaos_soak.py --minutes 20 [--fault-every 30 --seed 0]

The controller (``benchmarks/chaos/chaos_controller.py``: the demo with two built-in
servers, ``recover.mode=auto`` every step, a reward that can be made to hang, health
deadline ``rollout.health_check_timeout=10``) runs in its own process group. Faults are
injected in rounds; each round has every type once, in a seeded random order. The next
fault comes ``--fault-every`` seconds after the previous one was *recovered from* (a new
step completed after it) or given up on (``--survive-seconds``), so faults do not pile up
on a run that is still recovering (a relaunched controller killed again before its first
step measures the schedule, not the recovery):

- ``server_kill9``: SIGKILL one inference server (the watchdog restarts it in the
  background);
- ``server_sigstop``: SIGSTOP one server (hung: alive but silent) for ``--stop-seconds``,
  then SIGCONT if it is still there (the health deadline takes it out, its requests move,
  the watchdog kills and replaces it);
- ``dropped_connection``: every established TCP connection of the inference servers is
  reset (``ss -K``, needs CAP_NET_ADMIN) every 0.5 s for ``--drop-seconds``: in-flight
  requests, weight updates and fingerprint checks see a dropped connection;
- ``controller_kill9``: SIGKILL the controller, wait for its children, rerun the command
  (resumes from the last recover checkpoint);
- ``truncated_checkpoint``: SIGKILL the controller, truncate a file of the newest recover
  checkpoint (its COMPLETE marker stays), rerun (must fall back to the previous one);
- ``reward_hang``: every reward call hangs for ``--hang-seconds`` (longer than the
  reward timeout: the wrapper must kill it and count 0).

A fault is *survived* when a new training step completes within ``--survive-seconds``
after it; ``recovery_s_max`` is, per type, the longest time from the start of the
injection to that step. At the end the controller gets SIGTERM (graceful stop at a step
boundary). From ``consumed.jsonl`` (see ``Soak.audit``): ``samples_lost`` and
``samples_consumed_twice`` (after R rows every prompt must have been trained floor(R/64)
or ceil(R/64) times; a missing or repeated step counts too).
``longest_stall_s``: the longest wall-clock gap between two new steps seen in
``stats.jsonl`` (polled every 0.5 s; restarts and a resume from an older checkpoint
included), with the faults injected during that gap (``longest_stall_faults``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
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
    "dropped_connection",
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
        "rollout.health_check_interval=1",
        "rollout.health_check_timeout=10",
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
        self.last_step_time: float | None = None
        self.stalls: list[tuple[float, list[str]]] = []  # gap, faults injected in it
        self.faults_since_step: list[str] = []
        self.recovery: dict[str, float] = collections.defaultdict(float)
        self.dropped_sockets = 0
        self.orphans: list[str] = []  # children still alive after the controller's kill -9
        self.t0 = time.monotonic()
        self.timeline: list[dict] = []
        self.last_steps = -1
        self.injected = collections.Counter()
        self.survived = collections.Counter()
        self.pending: list[tuple[str, float, int]] = []  # fault, time, steps at injection
        self.server_restarts_seen = 0
        self.stopped: list[psutil.Process] = []
        self.stopping = False
        self.unexpected_exits = 0

    # ------------------------------------------------------------------ processes
    def event(self, what: str, **kw) -> None:
        self.timeline.append({"t": round(time.monotonic() - self.t0, 1), "event": what, **kw})

    def launch(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", AREAL_CHAOS_DIR=self.chaos_dir)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [REPO, os.path.dirname(CONTROLLER), env.get("PYTHONPATH")])
        )
        self.launches += 1
        self.event("launch", n=self.launches)
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
                if "areal.inference.server" in " ".join(c.cmdline()):
                    out.append(c)
            except psutil.Error:
                pass
        return out

    def kill_controller(self) -> None:
        t0 = time.monotonic()
        kids = self.children()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        for p in self.stopped:
            try:
                p.resume()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(kids, timeout=self.args.orphan_grace)
        for p in alive:  # should not happen: workers exit with their parent
            try:
                self.orphans.append(" ".join(p.cmdline())[:160])
                p.kill()
            except psutil.Error:
                pass
        self.event("controller killed", seconds=round(time.monotonic() - t0, 1))

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
                if self.last_step_time is not None:
                    gap = now - self.last_step_time
                    self.stalls.append((gap, self.faults_since_step))
                    if gap > 30:
                        self.event("step after a gap", seconds=round(gap, 1), steps=n)
                self.last_step_time = now
                self.faults_since_step = []
            self.last_steps = n
            for fault, t, n0 in list(self.pending):
                if n > n0:
                    self.survived[fault] += 1
                    self.recovery[fault] = max(self.recovery[fault], now - t)
                    self.pending.remove((fault, t, n0))
        for fault, t, n0 in list(self.pending):
            if now - t > self.args.survive_seconds:
                self.pending.remove((fault, t, n0))
        if self.proc.poll() is not None and not self.stopping:  # a crash we did not cause
            self.unexpected_exits += 1
            self.launch()

    # ------------------------------------------------------------------ faults
    def server_ports(self) -> list[int]:
        ports = []
        for p in self.servers():
            try:
                ports += [c.laddr.port for c in p.net_connections("tcp") if c.status == "LISTEN"]
            except psutil.Error:
                pass
        return ports

    def drop_connections(self, ports: list[int]) -> int:
        """Reset every established TCP connection from/to ``ports``; returns how many."""
        if not ports:
            return 0
        expr = " or ".join(f"sport = :{p} or dport = :{p}" for p in ports)
        r = subprocess.run(
            ["ss", "-K", "-t", "-n", "state", "established", f"( {expr} )"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"ss -K failed ({r.returncode}): {r.stderr.strip()}")
        return max(0, len([x for x in r.stdout.splitlines() if x.strip()]) - 1)

    def inject(self, fault: str) -> bool:
        n0 = self.steps()
        t_start = time.monotonic()
        self.event("inject", fault=fault, steps=n0)
        if fault == "dropped_connection":
            if shutil.which("ss") is None:
                return False
            t_end = time.monotonic() + self.args.drop_seconds
            while time.monotonic() < t_end:
                self.dropped_sockets += self.drop_connections(self.server_ports())
                self.poll()
                time.sleep(0.5)
        elif fault == "server_kill9":
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
        self.faults_since_step.append(fault)
        self.pending.append((fault, t_start, n0))
        self.event("injected", fault=fault)
        return True

    # ------------------------------------------------------------------ audit
    def audit(self) -> dict:
        """Samples lost / consumed twice, from ``consumed.jsonl``.

        The run consumes the dataloader's stream (epoch after epoch of the same 64 rows).
        An asynchronous run keeps up to ``max_concurrent_rollouts`` rows in flight, and a
        resumed run re-queues them, so a row of the next epoch may be trained a step or two
        before the last rows of the current one: per-epoch counts cannot tell that from a
        loss. Over the whole run, after R rows every prompt must have been trained
        floor(R/64) or ceil(R/64) times: fewer is a loss, more is a duplicate (each in
        samples, x n_samples). A step logged twice or missing counts as well.
        ``epoch_boundary_reorders``: prompts trained in a neighbouring epoch's steps.
        """
        path = os.path.join(self.log_dir, "consumed.jsonl")
        rows = []
        if os.path.exists(path):
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        steps = [r["global_step"] for r in rows]
        dup_steps = len(steps) - len(set(steps))
        gaps = sum(1 for a, b in zip(sorted(set(steps)), sorted(set(steps))[1:]) if b != a + 1)
        total: collections.Counter = collections.Counter()
        for r in rows:
            total.update(r["prompts"])
        n_rows = sum(total.values()) // N_SAMPLES
        lo, hi = n_rows // N_ROWS, -(-n_rows // N_ROWS)
        counts = [total.get(p, 0) // N_SAMPLES for p in self._all_prompts(total)]
        lost = sum(max(0, lo - c) for c in counts) * N_SAMPLES + gaps * BATCH * N_SAMPLES
        twice = sum(max(0, c - hi) for c in counts) * N_SAMPLES + dup_steps * BATCH * N_SAMPLES
        steps_per_epoch = N_ROWS // BATCH
        by_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        for r in rows:
            by_epoch[r["global_step"] // steps_per_epoch].update(r["prompts"])
        reorders = sum(
            max(0, c - N_SAMPLES) // N_SAMPLES for cnt in by_epoch.values() for c in cnt.values()
        )
        return {
            "samples_trained": sum(len(r["prompts"]) for r in rows),
            "samples_lost": lost,
            "samples_consumed_twice": twice,
            "epochs_completed": n_rows // N_ROWS,
            "epoch_boundary_reorders": reorders,
        }

    def _all_prompts(self, seen: collections.Counter) -> list[str]:
        """Every prompt of the dataset: those trained on, plus placeholders for the
        prompts never trained on (the dataset has N_ROWS distinct prompts)."""
        names = list(seen)
        return names + [f"<never trained #{i}>" for i in range(max(0, N_ROWS - len(names)))]

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
        load_start = os.getloadavg()
        next_fault = time.monotonic() + args.fault_every
        while time.monotonic() < deadline:
            self.poll()
            if self.pending:  # the next fault waits until the run recovered from this one
                next_fault = time.monotonic() + args.fault_every
            elif time.monotonic() >= next_fault:
                if not order:
                    order = random.sample(FAULTS, len(FAULTS))
                fault = order.pop()
                if not self.inject(fault):
                    print(f"fault {fault} could not be injected now", file=sys.stderr)
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
        load_end = os.getloadavg()
        gaps = [b - a for a, b in zip(self.step_times, self.step_times[1:])]
        worst = max(self.stalls, default=(0.0, []), key=lambda x: x[0])
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
            "longest_stall_faults": worst[1],
            "stalls_over_60s": [
                {"seconds": round(g, 1), "faults": f} for g, f in self.stalls if g > 60
            ],
            "recovery_s_max": {k: round(v, 1) for k, v in self.recovery.items()},
            "orphans_killed_by_soak": self.orphans,
            "dropped_sockets": self.dropped_sockets,
            "load_average_start": [round(x, 2) for x in load_start],
            "load_average_end": [round(x, 2) for x in load_end],
            "fault_every_s": args.fault_every,
            "median_step_s": round(sorted(gaps)[len(gaps) // 2], 1) if gaps else None,
            "final_exit_code": rc,
            "workdir": self.root,
        }
        out.update(self.audit())
        out["timeline"] = self.timeline
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--fault-every", type=float, default=30.0)
    ap.add_argument("--stop-seconds", type=float, default=20.0)
    ap.add_argument("--hang-seconds", type=float, default=25.0)
    ap.add_argument("--drop-seconds", type=float, default=5.0)
    ap.add_argument(
        "--orphan-grace",
        type=float,
        default=20.0,
        help="seconds the controller's children get to exit after its kill -9 (then SIGKILL)",
    )
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
