"""docs/cli_reference.md must match what docs/generate_cli_docs.py generates."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from areal.api.cli_args import GRPOConfig, PPOActorConfig

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "generate_cli_docs", REPO / "docs" / "generate_cli_docs.py"
)
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)
OUTPUT, collect_classes, main, render = gen.OUTPUT, gen.collect_classes, gen.main, gen.render


def test_committed_cli_reference_is_up_to_date():
    assert OUTPUT.exists(), "docs/cli_reference.md missing; run python docs/generate_cli_docs.py"
    assert OUTPUT.read_text() == render(), (
        "docs/cli_reference.md is stale; run python docs/generate_cli_docs.py"
    )


def test_check_flag_stale_file_exits_nonzero(tmp_path):
    stale = tmp_path / "ref.md"
    stale.write_text(render().replace("eps_clip", "eps_clap", 1))
    assert main(["--check", "--output", str(stale)]) == 1
    stale.write_text(render())
    assert main(["--check", "--output", str(stale)]) == 0


def test_check_script_runs_as_command():
    proc = subprocess.run(
        [sys.executable, "docs/generate_cli_docs.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_reference_lists_every_field_of_actor_with_help():
    text = render()
    assert "## PPOActorConfig" in text
    section = text.split("## PPOActorConfig", 1)[1].split("\n## ", 1)[0]
    for name in PPOActorConfig.__dataclass_fields__:
        assert f"| `{name}` |" in section
    assert "Allowed: `k1`, `k2`, `k3`." in section


def test_every_reachable_class_has_a_section():
    text = render()
    classes = collect_classes()
    assert GRPOConfig in classes
    for cls in classes:
        assert f"## {cls.__name__}\n" in text


def test_generator_covers_every_config_module():
    modules = {f"areal.api.{p.stem}" for p in (REPO / "areal" / "api").glob("*_config.py")}
    assert set(gen.CONFIG_MODULES) == modules


def test_every_dataclass_of_every_config_module_has_a_section():
    import dataclasses
    import importlib

    text = render()
    count = 0
    for name in gen.CONFIG_MODULES:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and dataclasses.is_dataclass(value)
                and value.__module__ == name
                and not value.__name__.startswith("_")
            ):
                assert f"## {value.__name__}\n" in text, (name, value.__name__)
                assert f"Defined in `{name}`." in text
                count += 1
    assert count >= 40


def test_every_public_config_name_importable_from_cli_args():
    import ast
    import importlib

    from areal.api import cli_args

    checked = 0
    for name in gen.CONFIG_MODULES + ["areal.api.config_loader", "areal.api.config_common"]:
        module = importlib.import_module(name)
        tree = ast.parse(Path(module.__file__).read_text())
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                attr = node.name
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                attr = getattr(target, "id", "")
            else:
                continue
            if attr.startswith("_") or attr in ("logger", "ConfigT"):
                continue
            assert getattr(cli_args, attr, None) is getattr(module, attr), f"cli_args.{attr}"
            checked += 1
    assert checked >= 60
