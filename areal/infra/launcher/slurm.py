"""Submit a controller script as a Slurm batch job (``scheduler.type=slurm``).

    python -m areal.infra.launcher.slurm [--partition P] [--cpus N] [--mem GB] [--time T]
        [--wait] [--sbatch-arg ARG ...] SCRIPT --config FILE.yaml [key=value ...]

Writes ``{cluster.fileroot}/logs/{experiment_name}/{trial_name}/controller.sbatch`` and
submits it with ``sbatch``; the job runs ``python SCRIPT ... scheduler.type=slurm`` (one
task), whose ``SlurmScheduler`` submits one more job per worker role. The controller's
output goes to ``controller-{jobid}.log`` in the same folder. The job id is logged (and
printed alone on stdout for scripts). ``--wait`` blocks until the job ends and returns
its exit code. ``SLURM_CONF`` and the current environment are passed on. A config with a
``post_exit_hook`` runs it inside the job after the controller exits (``LOG_DIR`` set; the
job's exit code stays the controller's).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

from areal.infra.launcher.common import run_names, script_command, script_config
from areal.utils import logging

logger = logging.getLogger("SlurmLauncher")


def build_script(
    script: str,
    script_args: list[str],
    log_dir: str,
    *,
    cpus: int = 2,
    mem_gb: int = 8,
    partition: str | None = None,
    time_limit: str | None = None,
    job_name: str = "areal-controller",
) -> str:
    cmd = script_command(script, script_args, "slurm")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        "#SBATCH --ntasks=1",
        f"#SBATCH --cpus-per-task={cpus}",
        f"#SBATCH --mem={mem_gb}G",
        f"#SBATCH --output={os.path.join(log_dir, 'controller-%j.log')}",
        f"#SBATCH --chdir={os.getcwd()}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time_limit:
        lines.append(f"#SBATCH --time={time_limit}")
    if os.environ.get("SLURM_CONF"):
        lines.append(f"export SLURM_CONF={shlex.quote(os.environ['SLURM_CONF'])}")
    if not _has_post_exit_hook(script_args):
        lines.append(f"exec {shlex.join(cmd)}")
    else:  # the controller, then the hook on the same node; the job's code is the controller's
        hook = [sys.executable, "-m", "areal.infra.launcher.common", *script_args]
        lines += [shlex.join(cmd), "rc=$?", shlex.join(hook), "exit $rc"]
    return "\n".join(lines) + "\n"


def _has_post_exit_hook(script_args: list[str]) -> bool:
    from omegaconf import OmegaConf

    return bool(
        str(
            OmegaConf.select(script_config(script_args), "post_exit_hook", default="") or ""
        ).strip()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.infra.launcher.slurm",
        description="Submit an areal controller script as a Slurm job (scheduler.type=slurm).",
    )
    parser.add_argument("--partition", default=None)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the controller task")
    parser.add_argument("--mem", type=int, default=8, help="memory of the controller job in GB")
    parser.add_argument("--time", dest="time_limit", default=None, help="sbatch --time")
    parser.add_argument("--wait", action="store_true", help="wait for the job; exit with its code")
    parser.add_argument("--sbatch-arg", action="append", default=[], help="extra sbatch argument")
    parser.add_argument("script", help="controller script, e.g. examples/math/gsm8k_rl.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="--config FILE and overrides")
    args = parser.parse_args(argv)
    fileroot, exp, trial = run_names(args.script_args)
    log_dir = os.path.join(fileroot, "logs", exp, trial)
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, "controller.sbatch")
    with open(path, "w") as f:
        f.write(
            build_script(
                args.script,
                args.script_args,
                log_dir,
                cpus=args.cpus,
                mem_gb=args.mem,
                partition=args.partition,
                time_limit=args.time_limit,
                job_name=f"areal-{exp}-{trial}",
            )
        )
    cmd = ["sbatch", "--parsable", *args.sbatch_arg, *(["--wait"] if args.wait else []), path]
    out = subprocess.run(cmd, capture_output=True, text=True)
    job_id = out.stdout.strip().split(";")[0]
    if job_id:
        logger.info(f"Submitted controller job {job_id}; log {log_dir}/controller-{job_id}.log")
        sys.stdout.write(job_id + "\n")
    if out.returncode != 0:
        logger.error(f"sbatch failed with exit code {out.returncode}: {out.stderr.strip()}")
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())
