"""Generate docs/cli_reference.md from the config dataclasses of areal/api.

The classes live in the config modules ``areal/api/*_config.py`` (re-exported by
``areal/api/cli_args.py``); every dataclass of every such module gets a section.

python docs/generate_cli_docs.py           # rewrite docs/cli_reference.md
python docs/generate_cli_docs.py --check   # exit 1 when the committed file is stale
"""

from __future__ import annotations

import argparse
import importlib
import sys
import typing
from dataclasses import MISSING as DC_MISSING
from dataclasses import fields, is_dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from omegaconf import MISSING  # noqa: E402

from areal.api import cli_args  # noqa: E402

OUTPUT = REPO / "docs" / "cli_reference.md"

# Every module of areal/api holding config dataclasses (tests check this list is complete).
CONFIG_MODULES = [
    "areal.api.experiment_config",
    "areal.api.engine_config",
    "areal.api.megatron_config",
    "areal.api.actor_config",
    "areal.api.inference_config",
    "areal.api.server_config",
    "areal.api.dataset_config",
    "areal.api.utils_config",
    "areal.api.health_config",
]

# Experiment configs first (what a YAML's top level is), then every class they reach.
ROOTS = [
    cli_args.GRPOConfig,
    cli_args.PPOConfig,
    cli_args.SFTConfig,
    cli_args.RWConfig,
    cli_args.DPOConfig,
    cli_args.BaseExperimentConfig,
]


def _anchor(cls: type) -> str:
    return cls.__name__.lower()


def _nested_dataclasses(tp: typing.Any) -> list[type]:
    found = []
    if isinstance(tp, type) and is_dataclass(tp):
        return [tp]
    for arg in typing.get_args(tp):
        found.extend(_nested_dataclasses(arg))
    return found


def module_classes() -> list[type]:
    """Every public dataclass defined in the CONFIG_MODULES, in source order."""
    found: list[type] = []
    for name in CONFIG_MODULES:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and is_dataclass(value)
                and value.__module__ == name
                and not value.__name__.startswith("_")
                and value not in found
            ):
                found.append(value)
    return found


def collect_classes() -> list[type]:
    """Every config dataclass reachable from ROOTS (breadth-first), then the rest of the
    CONFIG_MODULES' dataclasses."""
    seen: list[type] = []
    queue = list(ROOTS)
    while queue:
        cls = queue.pop(0)
        if cls in seen:
            continue
        seen.append(cls)
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            for sub in _nested_dataclasses(hints[f.name]):
                if sub not in seen:
                    queue.append(sub)
    seen += [cls for cls in module_classes() if cls not in seen]
    return seen


def _render_type(tp: typing.Any) -> str:
    text = cli_args.describe_type(tp)
    for sub in _nested_dataclasses(tp):
        text = text.replace(sub.__name__, f"[`{sub.__name__}`](#{_anchor(sub)})")
    return text


def _short_repr(value: typing.Any) -> str:
    """repr that shows only the non-default fields of dataclass values."""
    if is_dataclass(value) and not isinstance(value, type):
        default = type(value)()
        changed = [
            f"{f.name}={getattr(value, f.name)!r}"
            for f in fields(value)
            if getattr(value, f.name) != getattr(default, f.name)
        ]
        return f"{type(value).__name__}({', '.join(changed)})"
    if isinstance(value, list):
        return "[" + ", ".join(_short_repr(v) for v in value) + "]"
    return repr(value)


def _render_default(f) -> str:
    if f.default is not DC_MISSING:
        value = f.default
        if isinstance(value, str) and value == MISSING:
            return "**required**"
        return f"`{value!r}`"
    if f.default_factory is not DC_MISSING:
        value = f.default_factory()
        if is_dataclass(value):
            return "*section defaults*"
        return f"`{_short_repr(value)}`"
    return "**required**"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _render_deprecated() -> list[str]:
    return [
        "## Deprecated keys (migrated with a warning)",
        "",
        "| Key | Read as |",
        "| --- | --- |",
        "| `actor.behave_imp_weight_cap: X` / `actor.behav_imp_weight_cap: X` with "
        "`actor.behave_imp_weight_mode: M` | `actor.rejection_sampling: {level: token\\|sequence, "
        "action: mask\\|clamp, metric: ratio, upper: X}` (from M = `token_mask`, "
        "`token_truncate`, `sequence_mask`, `sequence_truncate`; `disabled` or no cap: `null`) |",
        "| `model:` section of `SFTConfig` / `RWConfig` (and `${model.x}` interpolations) "
        "| `actor:` |",
        "| `rollout.openai:` | `rollout.agent:` |",
        "",
    ]


def _render_not_acted_on() -> list[str]:
    """The one list of fields accepted (so AReaL YAMLs load) but not acted on."""
    out = [
        "## Accepted but not acted on",
        "",
        "These fields load, so AReaL YAMLs run unchanged, but nothing here acts on them: they "
        "need hardware or engines this project does not have, or a feature planned in a later "
        "issue. Setting one to a value other than its default logs one warning per run that "
        "names it (`cli_args.NOT_ACTED_ON`). Whole sections marked so in their description "
        "(e.g. `MegatronEngineConfig`) are covered through the field that holds them.",
        "",
        "| Field | Needs |",
        "| --- | --- |",
    ]
    for owner, name, why in cli_args.NOT_ACTED_ON:
        out.append(f"| `{owner}.{name}` | {_cell(why)} |")
    out.append("")
    return out


def render() -> str:
    classes = collect_classes()
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by docs/generate_cli_docs.py from areal/api/*_config.py; do not edit. -->",
        "",
        "Configs are YAML files loaded with `load_expr_config(argv, GRPOConfig)`. Every class",
        "below is importable from `areal.api.cli_args`; each section names the module that",
        "defines it.",
        "",
        "",
        "```bash",
        "python examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo.yaml actor.optimizer.lr=1e-4 +scheduler.type=local",
        "```",
        "",
        "Command-line overrides take AReaL's (Hydra's) forms: `a.b=value` sets a key,",
        "`+a.b=value` / `++a.b=value` as well (for keys absent from the YAML), list items by",
        "index (`actor.scheduling_spec.0.gpu=0`), `~a.b` removes a key from the YAML so its",
        "default applies. Values are read as YAML (`[1,2]`, `{k: v}`, `null`, `'quoted'`);",
        "`${a.b}` interpolates another key. Unknown keys, wrong types and invalid values are",
        "errors that name the dotted key. Sections whose `experiment_name`, `trial_name` or",
        "`fileroot` are not given inherit the top-level values (`fileroot` from",
        "`cluster.fileroot`). The resolved config is written to",
        "`{cluster.fileroot}/logs/{experiment_name}/{trial_name}/config.yaml`.",
        "",
        "## Running a GPU config on CPU",
        "",
        "With `cluster.n_gpus_per_node=0` (e.g. on the command line) a config written for GPUs",
        "loads for CPU: every `scheduling_spec[*].gpu` above 0 is set to 0, and every training",
        "engine's `dtype` / `grad_reduce_dtype` other than `float32` becomes `float32`; one",
        "warning per kind names the changed keys. Why float32: torch runs bfloat16 on CPU, but",
        "on this project's reference CPU (2 cores, no AVX512-BF16/AMX) one train step of the",
        "tiny model (16 x 128 tokens) took 10.1 s in bfloat16 against 1.6 s in float32. The",
        "`vllm.dtype` / `sglang.dtype` of external servers are left to those servers. Backends",
        "and sizes are overridden as usual, e.g.",
        "`allocation_mode=local:d1+fsdp:d1 actor.backend=fsdp:d1 rollout.backend=local:d1`.",
        "",
        "On a CPU with bf16 matrix instructions (AVX-512-BF16 or AMX-BF16) training can run",
        "its forward and backward in bfloat16: `actor.cpu_compute_dtype=bfloat16` (or `auto`,",
        "which picks bfloat16 only on such CPUs) keeps float32 master weights, optimizer",
        "states, gradient reduction and log-probabilities (FSDP2 mixed precision). Measured",
        'figures and the logprob mismatch it adds: docs/benchmarks.md, "On an AVX-512-BF16',
        'CPU".',
        "",
    ]
    out += _render_deprecated() + _render_not_acted_on()
    out += ["## Sections", ""]
    for cls in classes:
        out.append(f"- [`{cls.__name__}`](#{_anchor(cls)})")
    out.append("")
    for cls in classes:
        doc = " ".join((cls.__doc__ or "").split())
        out += [f"## {cls.__name__}", "", f'<a id="{_anchor(cls)}"></a>', ""]
        if doc:
            out += [doc, ""]
        out += [f"Defined in `{cls.__module__}`.", ""]
        out += ["| Field | Type | Default | Description |", "| --- | --- | --- | --- |"]
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            help_text = f.metadata.get("help", "")
            choices = f.metadata.get("choices")
            if choices:
                help_text += " Allowed: " + ", ".join(f"`{c}`" for c in choices) + "."
            out.append(
                f"| `{f.name}` | {_cell(_render_type(hints[f.name]))} | {_cell(_render_default(f))} "
                f"| {_cell(help_text)} |"
            )
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="fail when the committed file is stale"
    )
    parser.add_argument("--output", default=str(OUTPUT), help="file to write or check")
    args = parser.parse_args(argv)
    text = render()
    path = Path(args.output)
    if args.check:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} is stale; run: python docs/generate_cli_docs.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
