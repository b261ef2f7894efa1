"""One-call check of areal's CUDA paths on a lent GPU machine (``make gpu-check``).

Runs on the machine as it is (its own Python, torch and transformers; no network).
Packages areal needs that are missing there are installed from the wheel folder
``.gpu-wheels/`` (made here with ``make gpu-wheels`` and carried with the working tree).

Steps, each timed, results in ``$OUT/gpu_check.json`` (or ``--out``):

1. environment: GPU, torch / CUDA / transformers versions;
2. missing dependencies installed from ``.gpu-wheels/`` (``pip --no-index``);
3. the ``gpu``-marked tests (``tests/test_gpu.py``: bf16 FSDP2 over NCCL; bf16
   ArchonEngine over NCCL, qwen3 and qwen3_moe on one GPU, ``d1t2`` with two; the
   built-in server on CUDA vs HF);
4. 20 steps of the demo (``examples/math/gsm8k_grpo_cpu.yaml``) with the trainer and the
   built-in server on the GPU: held-out accuracy before/after, seconds per step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (module to import, distribution to install when it is missing)
NEEDED = [
    ("omegaconf", "omegaconf"),
    ("math_verify", "math-verify"),
    ("torchdata", "torchdata"),
    ("aiohttp", "aiohttp"),
    ("requests", "requests"),
    ("tensorboard", "tensorboard"),
    ("tqdm", "tqdm"),
    ("matplotlib", "matplotlib"),
    ("psutil", "psutil"),
    ("yaml", "pyyaml"),
    ("safetensors", "safetensors"),
    ("pytest", "pytest"),
    ("pytest_asyncio", "pytest-asyncio"),
    ("pytest_timeout", "pytest-timeout"),
    ("hypothesis", "hypothesis"),
    ("fastapi", "fastapi"),
    ("uvicorn", "uvicorn"),
    ("openai", "openai"),
]


# Present on the lent GPU machine (its own torch stack): never carried.
PRESENT_THERE = {
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "accelerate",
    "huggingface-hub",
    "numpy",
    "filelock",
    "jinja2",
    "markupsafe",
    "sympy",
    "mpmath",
    "networkx",
    "fsspec",
    "packaging",
    "regex",
    "typing-extensions",
    "peft",
    "triton",
    "setuptools",
    "pip",
    "wheel",
}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(dists: list[str]) -> dict[str, str]:
    """``{name: version}`` of ``dists`` and their dependencies as installed HERE."""
    from importlib import metadata

    from packaging.requirements import Requirement

    todo, seen = list(dists), {}
    while todo:
        name = _canon(todo.pop())
        if name in seen or name in PRESENT_THERE or name.startswith("nvidia-"):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = dist.version
        for req in dist.requires or []:
            r = Requirement(req)
            if r.marker is not None and not r.marker.evaluate({"extra": ""}):
                continue
            todo.append(r.name)
    return seen


def download_wheels(wheel_dir: str, python_version: str = "3.12") -> dict:
    """Fetch (from the package registry, here) cp312 wheels of what the GPU machine lacks."""
    os.makedirs(wheel_dir, exist_ok=True)
    pins = _closure([dist for _, dist in NEEDED])
    failed = {}
    for name, version in sorted(pins.items()):
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python_version,
            "--implementation",
            "cp",
            "--platform",
            "manylinux_2_28_x86_64",
            "--platform",
            "manylinux_2_17_x86_64",
            "--platform",
            "manylinux2014_x86_64",
            "--platform",
            "any",
            "-d",
            wheel_dir,
            f"{name}=={version}",
        ]
        rc, out, _ = _run(cmd, timeout=600)
        if rc != 0:  # sdist-only (pure Python) packages: build a wheel here
            rc, out, _ = _run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "wheel",
                    "--quiet",
                    "--no-deps",
                    "-w",
                    wheel_dir,
                    f"{name}=={version}",
                ],
                timeout=600,
            )
            if rc != 0:
                failed[name] = out[-400:]
    size = sum(os.path.getsize(os.path.join(wheel_dir, f)) for f in os.listdir(wheel_dir))
    return {"wheels": len(os.listdir(wheel_dir)), "mib": round(size / 2**20, 1), "failed": failed}


def _run(cmd: list[str], timeout: float, env: dict | None = None, log: str | None = None):
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"TIMEOUT after {timeout}s\n{e.stdout or ''}{e.stderr or ''}"
    if log:
        with open(log, "w") as f:
            f.write(out)
    return rc, out, time.monotonic() - t0


def environment() -> dict:
    import torch

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
    return info


def install_missing(wheel_dir: str) -> dict:
    missing = [dist for mod, dist in NEEDED if importlib.util.find_spec(mod) is None]
    res = {"missing": missing, "installed": [], "failed": []}
    if not missing:
        return res
    if not os.path.isdir(wheel_dir):
        res["failed"] = missing
        res["error"] = f"{wheel_dir} not found (run `make gpu-wheels` before carrying the tree)"
        return res
    for dist in missing:
        rc, out, _ = _run(
            [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", wheel_dir, dist],
            timeout=300,
        )
        (res["installed"] if rc == 0 else res["failed"]).append(dist)
        if rc != 0:
            res.setdefault("errors", {})[dist] = out[-800:]
    return res


def gpu_tests(out_dir: str, env: dict) -> dict:
    rc, out, secs = _run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "tests/test_gpu.py",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
        ],
        timeout=900,
        env=env,
        log=os.path.join(out_dir, "gpu_tests.log"),
    )
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", out)}
    return {"rc": rc, "seconds": round(secs, 1), **counts, "tail": out[-3000:]}


def demo(out_dir: str, env: dict, steps: int) -> dict:
    fileroot = os.path.join(out_dir, "demo")
    cmd = [
        sys.executable,
        "examples/math/gsm8k_rl.py",
        "--config",
        "examples/math/gsm8k_grpo_cpu.yaml",
        f"total_train_steps={steps}",
        f"evaluator.freq_steps={steps}",
        "recover.mode=disabled",
        "trial_name=gpu-check",
        f"cluster.fileroot={fileroot}",
    ]
    rc, out, secs = _run(cmd, timeout=1200, env=env, log=os.path.join(out_dir, "demo.log"))
    res: dict = {"rc": rc, "seconds": round(secs, 1), "command": " ".join(cmd[1:])}
    stats_path = os.path.join(fileroot, "logs", "gsm8k-grpo-cpu", "gpu-check", "stats.jsonl")
    if os.path.exists(stats_path):
        rows = [json.loads(line) for line in open(stats_path) if line.strip()]
        evals = [r for r in rows if "eval/accuracy" in r]
        steps_rows = [r for r in rows if "batch/reward" in r]
        res["steps_done"] = len(steps_rows)
        res["eval_accuracy"] = [r["eval/accuracy"] for r in evals]
        res["reward_first_last"] = (
            [steps_rows[0]["batch/reward"], steps_rows[-1]["batch/reward"]] if steps_rows else None
        )
        step_times = [r.get("time/rollout", 0) + r.get("time/train_step", 0) for r in steps_rows]
        if step_times:
            res["mean_step_seconds"] = round(sum(step_times) / len(step_times), 3)
    res["tail"] = out[-3000:]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "gpu_check_out")))
    ap.add_argument("--wheels", default=os.path.join(ROOT, ".gpu-wheels"))
    ap.add_argument("--demo-steps", type=int, default=20)
    ap.add_argument("--skip-demo", action="store_true")
    ap.add_argument(
        "--download-wheels",
        action="store_true",
        help="run HERE (with registry access): fill --wheels for the GPU machine, then exit",
    )
    args = ap.parse_args(argv)
    if args.download_wheels:
        print(json.dumps(download_wheels(args.wheels), indent=2))
        return 0
    os.makedirs(args.out, exist_ok=True)
    report: dict = {"environment": environment()}
    report["dependencies"] = install_missing(args.wheels)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    report["gpu_tests"] = gpu_tests(args.out, env)
    if not args.skip_demo:
        report["demo"] = demo(args.out, env, args.demo_steps)
    path = os.path.join(args.out, "gpu_check.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    summary = {
        k: {kk: vv for kk, vv in v.items() if kk != "tail"} if isinstance(v, dict) else v
        for k, v in report.items()
    }
    print(json.dumps(summary, indent=2))
    ok = report["gpu_tests"]["rc"] == 0 and (args.skip_demo or report["demo"]["rc"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
