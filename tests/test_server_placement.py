"""Inference servers are placed by the rollout role's scheduling spec (nodelist/exclude)."""

from __future__ import annotations

from areal.api.alloc_mode import AllocationMode
from areal.api.cli_args import SchedulingSpec
from areal.api.scheduler_api import Worker
from areal.infra.scheduler.servers import launch_inference_servers, launch_server_workers


class _RecordingScheduler:
    def __init__(self):
        self.jobs = []

    def create_workers(self, job, timeout=None):
        self.jobs.append(job)

    def get_workers(self, role, timeout=None):
        return [
            Worker(id=f"{role}/{i}", ip="10.0.0.2", worker_ports=["1234"])
            for i in range(self.jobs[-1].replicas)
        ]


def test_launch_server_workers_placement_copies_nodelist_and_exclude():
    sched = _RecordingScheduler()
    placement = SchedulingSpec(nodelist="nb", exclude="na", cpu=7)
    launch_server_workers(sched, 2, "serve --host {host} --port {port}", placement=placement)
    spec = sched.jobs[0].tasks[0]
    assert (spec.nodelist, spec.exclude) == ("nb", "na")
    assert spec.cpu == 1 and spec.cmd.startswith("serve")  # resources stay the launcher's


def test_launch_inference_servers_uses_rollout_scheduling_spec():
    from areal.api.experiment_config import GRPOConfig

    cfg = GRPOConfig()
    cfg.rollout.scheduling_spec = [SchedulingSpec(nodelist="nb")]
    sched = _RecordingScheduler()
    launch_inference_servers(
        sched, AllocationMode.from_str("local:d1+fsdp:d1"), "serve {host} {port}", config=cfg
    )
    assert sched.jobs[0].tasks[0].nodelist == "nb"
    launch_server_workers(sched, 1, "serve {host} {port}")
    assert sched.jobs[1].tasks[0].nodelist is None
