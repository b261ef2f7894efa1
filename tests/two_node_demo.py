"""The GRPO demo across the nodes of a namespace cluster: command line and checks.

Shared by ``tests/test_ray_two_nodes.py`` and ``tests/test_slurm_two_nodes.py``: the
demo configuration (``examples/math/gsm8k_grpo_cpu.yaml``) at a reduced batch, the
trainer pinned to one node and one server on each of the other nodes
(``actor.scheduling_spec.0.nodelist`` / ``rollout.scheduling_spec.0.nodelist``), weight
updates over xccl (gloo) across the bridge, held-out greedy accuracy before and after.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = int(os.environ.get("AREAL_TWO_NODE_STEPS", "20"))
# held-out problems scored greedily before and after RL (the demo's own eval records)
EVAL_N = 64
# the accuracy after RL must beat the base by this much (measured, see docs/cluster.md)
MIN_GAIN = 0.2


def demo_command(
    fileroot, scheduler_type: str, trial: str, trainer_nodes: str, server_nodes: str,
    n_servers: int, steps: int = STEPS,
) -> list[str]:  # fmt: skip
    batch = 8
    return [
        sys.executable,
        os.path.join(REPO, "examples/math/gsm8k_rl.py"),
        "--config",
        os.path.join(REPO, "examples/math/gsm8k_grpo_cpu.yaml"),
        f"scheduler.type={scheduler_type}",
        f"allocation_mode=local:d{n_servers}+fsdp:d1",
        f"cluster.fileroot={fileroot}",
        f"trial_name={trial}",
        f"total_train_steps={steps}",
        f"train_dataset.batch_size={batch}",
        f"train_dataset.path=synthetic://arith?digits=1&steps=2&n={batch * steps * 2}&seed=0",
        f"valid_dataset.path=synthetic://arith?digits=1&steps=2&n={EVAL_N}&seed=12345",
        f"valid_dataset.batch_size={EVAL_N}",
        "evaluator.freq_steps=null",  # before training and after the last step only
        "recover.mode=disabled",
        f"actor.scheduling_spec.0.nodelist={trainer_nodes}",
        f"rollout.scheduling_spec.0.nodelist={server_nodes}",
        "actor.weight_update_mode=xccl",  # the weight broadcast crosses the nodes (gloo)
    ]


def run_demo(cmd: list[str], env: dict[str, str], out_path, timeout: float = 600,
             netns: str | None = None) -> str:  # fmt: skip
    """Run the controller (inside ``netns`` when given); its output, or a test failure."""
    env = dict(env, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    argv = ["ip", "netns", "exec", netns, *cmd] if netns else cmd
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        with open(out_path, "w") as f:
            f.write(out)
        pytest.fail(
            f"two-node demo timed out after {timeout} s (output {out_path}):\n{out[-6000:]}"
        )
    with open(out_path, "w") as f:
        f.write(out)
    assert proc.returncode == 0, (
        f"demo exited {proc.returncode} (output {out_path}):\n{out[-6000:]}"
    )
    return out


def held_out_accuracy(out: str) -> tuple[float, float]:
    """(before, after) from the demo's summary lines."""
    before = re.search(r"held-out accuracy before RL: ([\d.]+)", out)
    after = re.search(r"held-out accuracy after  RL: ([\d.]+)\s+\((\d+) steps\)", out)
    assert before and after, f"no held-out accuracy lines in the output:\n{out[-4000:]}"
    assert int(after.group(2)) == STEPS, after.group(0)
    return float(before.group(1)), float(after.group(1))


def assert_learned(out: str) -> None:
    before, after = held_out_accuracy(out)
    assert after >= before + MIN_GAIN, (
        f"held-out accuracy did not rise as in the one-node demo: {before:.3f} -> "
        f"{after:.3f} after {STEPS} steps (need +{MIN_GAIN})"
    )


def assert_weights_verified(out: str, n_servers: int) -> None:
    for v in range(1, STEPS + 1):
        line = f"weights of version {v} verified on {n_servers} server(s)"
        assert line in out, f"missing {line!r}:\n{out[-6000:]}"


def assert_servers_bound(logs, addrs: list[str]) -> None:
    """Server ``i``'s log (``rollout-<i>.log`` in ``logs``) shows it serving on
    ``addrs[i]``, its own node's address, and never names ``0.0.0.0``."""
    for i, addr in enumerate(addrs):
        server_log = (logs / f"rollout-{i}.log").read_text()
        assert f"on http://{addr}:" in server_log, server_log[-3000:]
        assert "0.0.0.0" not in server_log, server_log[-3000:]
