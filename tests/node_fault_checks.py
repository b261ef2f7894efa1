"""Run the demo with a fault once step 1 is logged; check that no sample was lost.

Shared by the node-fault tests under Slurm (``tests/test_node_faults.py``,
``tests/test_node_link_cut.py``) and Ray (``tests/test_ray_two_nodes.py``). The demo
draws from ``MAX_STEPS * batch`` distinct prompts; its records (``stats.jsonl``: one row
per step; ``consumed.jsonl``: the prompt hashes each step trained on) must show every
completed step and every prompt drawn trained exactly ``n_samples`` times: none lost with
the node, none generated twice.

Run length: by what the test waits for, not by a step count (a step takes 0.15-2 s by
CPU kind and load, so a fixed count ends a fast run before the restart lands).
``total_train_steps=MAX_STEPS`` is far more than any test needs; ``run_with_fault(...,
stop_when=pred, then_steps=N)`` watches ``stats.jsonl`` until ``pred(rows)`` holds (e.g.
``rollout/server_restarts_total >= 1``), lets ``N`` more steps complete, and then ends
the run the project's own way: SIGTERM to the controller (docs/fault_tolerance.md,
"Stopping: SIGTERM and Ctrl-C": the step in progress finishes, ``close()`` stops every
worker and server, exit 143, ``Stopped by SIGTERM ...`` in the log).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time

import pytest
from _jsonl import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENT = "gsm8k-grpo-cpu"
#: total_train_steps of a fault run: never reached, the test ends the run (module docstring);
#: the first 8000 rows of the seed-3 data are distinct prompts
MAX_STEPS = 2000
#: the exit code of a controller stopped by SIGTERM (128 + 15)
SIGTERM_EXIT = 128 + signal.SIGTERM


def fault_args(steps: int, batch: int, n_samples: int, health_timeout: float) -> list[str]:
    """Overrides of the demo for a fault run of at most ``steps`` steps (``MAX_STEPS`` for a
    run the test stops), one epoch of ``steps * batch`` rows at most, every row once."""
    return [
        "allocation_mode=local:d2+fsdp:d1",
        f"total_train_steps={steps}",
        f"train_dataset.batch_size={batch}",
        f"gconfig.n_samples={n_samples}",
        f"train_dataset.path=synthetic://arith?digits=2&steps=2&n={steps * batch}&seed=3",
        "actor.dynamic_sampling=false",
        f"rollout.health_check_timeout={health_timeout}",
        "rollout.request_timeout=20",
        "rollout.setup_timeout=120",
    ]


def slurm_fault_command(
    fileroot, trial: str, steps: int, batch: int, n_samples: int, health_timeout: float
) -> list[str]:
    """The Slurm demo (``slurm_fixture.demo_command``) for a fault run: trainer on node
    A, one server on each of B and C."""
    from slurm_fixture import demo_command

    drop = ("total_train_steps=", "train_dataset.path=", "allocation_mode=", "trial_name=")
    drop += ("gconfig.n_samples=", "train_dataset.batch_size=")
    cmd = [a for a in demo_command(fileroot, "slurm") if not a.startswith(drop)]
    return cmd + [
        f"trial_name={trial}",
        *fault_args(steps, batch, n_samples, health_timeout),
        "actor.scheduling_spec.0.nodelist=na",
        "rollout.scheduling_spec.0.nodelist=nb,nc",
    ]


def records(fileroot, trial: str, name: str) -> list[dict]:
    return read_jsonl(os.path.join(str(fileroot), "logs", EXPERIMENT, trial, name))


def step_rows(fileroot, trial: str) -> list[dict]:
    """The per-step rows of ``stats.jsonl`` (evaluation rows left out)."""
    return [r for r in records(fileroot, trial, "stats.jsonl") if "batch/reward" in r]


def stat_at_least(key: str, value: float = 1.0):
    """A ``stop_when`` predicate: the last step row has ``key`` >= ``value``."""
    return lambda rows: bool(rows) and rows[-1].get(key, 0.0) >= value


def run_with_fault(
    fileroot, cmd: list[str], env: dict, trial: str, fault, timeout: float = 600,
    netns: str | None = None, after_step: int = 1, stop_when=None, then_steps: int = 3,
) -> str:  # fmt: skip
    """Run ``cmd`` (inside ``netns`` when given); once step ``after_step`` is in
    ``stats.jsonl`` call ``fault()``; return the output.

    Without ``stop_when`` the run must end by itself with exit 0. With it, once
    ``stop_when(step rows)`` holds and ``then_steps`` more steps are logged, the controller
    gets SIGTERM and must exit 143 having logged ``Stopped by SIGTERM``; a run that ends
    by itself first (``total_train_steps`` reached: not a long enough run) fails."""
    log = os.path.join(str(fileroot), f"{trial}.out")
    env = dict(env, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    argv = ["ip", "netns", "exec", netns, *cmd] if netns else cmd
    with open(log, "w") as f:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )

    def tail() -> str:
        with open(log, errors="replace") as f:
            return f.read()[-6000:]

    deadline = time.monotonic() + timeout
    try:
        while not any(
            r.get("global_step", -1) >= after_step for r in records(fileroot, trial, "stats.jsonl")
        ):
            assert proc.poll() is None, tail()
            assert time.monotonic() < deadline, f"step {after_step} never came\n" + tail()
            time.sleep(0.3)
        fault()
        if stop_when is not None:
            seen_at = None  # the step count when stop_when first held
            while True:
                rows = step_rows(fileroot, trial)
                if seen_at is None and stop_when(rows):
                    seen_at = len(rows)
                if seen_at is not None and len(rows) >= seen_at + then_steps:
                    break
                assert proc.poll() is None, "the run ended before the test stopped it\n" + tail()
                assert time.monotonic() < deadline, (
                    f"{'' if seen_at else 'the awaited event never came; '}run not stopped "
                    f"within {timeout} s\n" + tail()
                )
                time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)  # `ip netns exec` execs: this is the controller
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        pytest.fail(f"run did not end within {timeout} s:\n{tail()}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    with open(log, errors="replace") as f:
        out = f.read()
    if stop_when is None:
        assert proc.returncode == 0, out[-6000:]
    else:
        assert proc.returncode == SIGTERM_EXIT, out[-6000:]
        assert "Stopped by SIGTERM" in out, out[-6000:]
    return out


def assert_no_sample_lost_or_duplicated(
    fileroot, trial: str, steps: int | None, batch: int, n_samples: int
) -> list[dict]:
    """Every step ran (``steps``; None: the steps the run completed before it was
    stopped); each of the ``steps * batch`` prompts drawn was trained on ``n_samples``
    times; returns the per-step stats rows."""
    stats = step_rows(fileroot, trial)
    steps = len(stats) if steps is None else steps
    assert [r["global_step"] for r in stats] == list(range(steps)), stats
    consumed = records(fileroot, trial, "consumed.jsonl")
    assert [r["global_step"] for r in consumed] == list(range(steps))
    assert all(len(r["prompts"]) == batch * n_samples for r in consumed)
    counts = collections.Counter(h for r in consumed for h in r["prompts"])
    # one epoch of steps * batch distinct prompts, each trained on with its n_samples
    assert len(counts) == steps * batch, counts
    assert set(counts.values()) == {n_samples}, counts
    return stats
