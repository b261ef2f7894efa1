"""The releasable package: version, changelog, the demo module's config, the wheel's contents.

The full check (wheel into a clean venv with torch first, ``python -m areal.demo --steps 3``
outside the repository) is run by hand; see CONTRIBUTING.md ("Releasing").
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import areal
from areal import demo

REPO = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_version_in_pyproject_matches_package_and_changelog():
    version = _pyproject()["project"]["version"]
    assert areal.__version__ == version
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert f"## [{version}]" in changelog, f"CHANGELOG.md has no section for {version}"


def _as_dict(config) -> dict:
    d = dataclasses.asdict(config)
    d.pop("tokenizer_path")
    d["actor"].pop("path")
    return d


def _diff(a, b, prefix=""):
    """Differing leaves, as 'dotted.key: a != b'; experiment_name (any level) excluded."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k == "experiment_name":
                continue
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]}: {a!r} != {b!r}"]


def test_demo_config_matches_example_yaml_except_name_and_model_path(tmp_path):
    """`python -m areal.demo` and `make demo` train with the same settings."""
    from areal.api.cli_args import GRPOConfig, load_expr_config

    root = f"cluster.fileroot={tmp_path}"
    example, _ = load_expr_config(
        ["--config", str(REPO / "examples/math/gsm8k_grpo_cpu.yaml"), root], GRPOConfig
    )
    ours = demo.build_config(["--fileroot", str(tmp_path)])
    assert ours.experiment_name == "areal-demo"  # never resumes a `make demo` run
    assert Path(ours.actor.path).samefile(REPO / "areal/models/assets/tiny-base")
    differences = _diff(_as_dict(example), _as_dict(ours))
    assert not differences, "areal/demo.py DEMO_YAML drifted from the example:\n" + "\n".join(
        differences
    )


def test_demo_command_line_sizes_and_overrides_reach_config(tmp_path):
    cfg = demo.build_config(
        ["--steps", "3", "--eval-n", "64", "--fileroot", str(tmp_path), "gconfig.n_samples=4"]
    )
    assert cfg.total_train_steps == 3
    assert "n=64&" in cfg.valid_dataset.path and cfg.valid_dataset.batch_size == 64
    assert cfg.gconfig.n_samples == 4 and cfg.actor.group_size == 4
    assert cfg.cluster.fileroot == str(tmp_path)


@pytest.mark.parametrize(
    "argv", [["--steps", "0"], ["--eval-n", "0"], ["--unknown-flag"], ["not_an_override"]]
)
def test_demo_bad_arguments_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.parse_args(argv)
    assert exc.value.code == 2
    assert "python -m areal.demo" in capsys.readouterr().err


@pytest.mark.slow
def test_wheel_contains_model_assets_and_demo(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--skip-dependency-check",
            "--outdir",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    version = _pyproject()["project"]["version"]
    wheels = list(tmp_path.glob(f"areal-{version}-py3-none-any.whl"))
    assert len(wheels) == 1, list(tmp_path.iterdir())
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    assets = REPO / "areal/models/assets/tiny-base"
    expected = {f"areal/models/assets/tiny-base/{p.name}" for p in assets.iterdir() if p.is_file()}
    assert {"areal/models/assets/tiny-base/model.safetensors", "areal/demo.py"} <= names
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    assert not any(n.startswith(("tests/", "docs/", "examples/")) for n in names)
    metadata = zipfile.ZipFile(wheels[0]).read(f"areal-{version}.dist-info/METADATA").decode()
    assert "Requires-Dist: torch==2.13.0" in metadata
    # the embedded tiny models are ~19 MiB of the wheel; everything else (code, templates,
    # tokenizer files of the package) stays small: a data file shipped by mistake fails here
    infos = zipfile.ZipFile(wheels[0]).infolist()
    rest = sum(i.compress_size for i in infos if not i.filename.startswith("areal/models/assets/"))
    assert rest < 2 * 2**20, f"{rest / 2**20:.2f} MiB of the wheel outside the model assets"
    assert wheels[0].stat().st_size < 24 * 2**20
