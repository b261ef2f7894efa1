"""README.md's learning-claims table is the rendering of docs/claims.json (`make claims`).

Fast: reads files only. The claims themselves run in `make claims`
(benchmarks/claims/run.py).
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


render_claims = _load("render_claims", ROOT / "tools" / "render_claims.py")
table = _load("claims_table", ROOT / "benchmarks" / "claims" / "table.py")


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((ROOT / "docs" / "claims.json").read_text())


def test_readme_claims_table_matches_docs_claims_json(report):
    readme = (ROOT / "README.md").read_text()
    assert render_claims.current_block(readme) == render_claims.render(report), (
        "README.md's claims table differs from docs/claims.json: run "
        "`python tools/render_claims.py` (or `make claims CLAIMS_ARGS=--write-docs`)"
    )


def test_docs_claims_json_covers_every_claim_with_its_current_threshold(report):
    rows = {r["claim"]: r for r in report["claims"]}
    assert list(rows) == [c.name for c in table.CLAIMS]
    for claim in table.CLAIMS:
        row = rows[claim.name]
        assert row["steps"] == claim.steps, claim.name
        assert row["threshold"] == claim.threshold, claim.name
        assert [c["name"] for c in row["controls"]] == [c.name for c in claim.controls]


def test_docs_claims_json_pass_column_follows_from_its_figures(report):
    for row in report["claims"]:
        ok = row["measured"] is not None and row["measured"] >= row["threshold"]
        ok = ok and all(
            c["measured"] is not None and c["measured"] < row["threshold"] for c in row["controls"]
        )
        assert row["pass"] == ok, row["claim"]
    assert report["passed"] == all(r["pass"] for r in report["claims"])


def test_render_claims_check_fails_on_an_edited_table(tmp_path, report):
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    first = report["claims"][0]
    edited = text.replace(
        f"**{100 * first['measured']:.1f}%**", f"**{100 * first['measured'] + 1:.1f}%**", 1
    )
    assert edited != text
    readme.write_text(edited)
    rc = render_claims.main(["--check", "--readme", str(readme)])
    assert rc == 1
    readme.write_text(text)
    assert render_claims.main(["--check", "--readme", str(readme)]) == 0


def test_claim_parsers_read_the_example_scripts_output_lines():
    demo = "held-out accuracy before RL: 0.232\nheld-out accuracy after  RL: 0.971  (100 steps)\n"
    assert table.ACCURACY(demo) == (0.232, 0.971)
    tool = "  expression_correct   before 0.473  after 0.652\n  success  before   -    after 0.5\n"
    assert table.tool_metric("expression_correct")(tool) == (0.473, 0.652)
    line = json.dumps({"heldout_before": {"accuracy": 0.47}, "heldout_after": {"accuracy": 0.93}})
    assert table.json_line("accuracy")("noise\n" + line + "\n") == (0.47, 0.93)
    assert table.ACCURACY("Traceback (most recent call last):\n") == (None, None)


def test_controls_skip_the_evaluation_before_training_and_the_claims_run_keeps_it():
    # the claim's own run measures "before"; a control (same base, seed, held-out set)
    # would only repeat it
    for claim in table.CLAIMS:
        main = claim.argv("out/x", trial="true-rewards")
        control = claim.argv("out/y", trial="shuffled", control=True)
        assert "evaluator.eval_before_train=false" not in main
        if claim.rl_overrides:
            assert "evaluator.eval_before_train=false" in control
            yaml_text = (ROOT / claim.config).read_text()
            assert "eval_before_train: true" in yaml_text, claim.name
        else:  # DPO/RW: no evaluator settings, no controls
            assert not claim.controls


def test_runs_are_scheduled_one_by_one_and_assembled_back_into_their_claims(monkeypatch):
    run = _load("claims_run", ROOT / "benchmarks" / "claims" / "run.py")
    started, skipped = [], []

    def fake_run_one(claim, label, control, broken, out, skip_before=False):
        started.append((claim.name, label))
        if skip_before:
            skipped.append((claim.name, label))
        passed = control is None and not broken
        return {
            "run": label,
            "before": 0.2 if control is None and not skip_before else None,
            "measured": 0.99 if passed else 0.0,
            "exit_code": 0,
            "wall_s": 1.0,
            "cpu_s": 1.0,
            "command": "x",
            "log": "x",
        }

    monkeypatch.setattr(run, "run_one", fake_run_one)
    monkeypatch.setattr(run, "finish", lambda report, path, write: report)
    report = run.main(
        [
            "--only",
            "demo,vlm,dpo,lora",
            "--break",
            "dpo",
            "--jobs",
            "1",
            "--out",
            "/nonexistent-claims-out",
        ]
    )
    # a run never recorded (the broken one) goes first, then the longest recorded (one
    # of the VLM's); every run once
    walls = run.last_walls()
    assert started[0] == ("dpo", "constant reward, broken on purpose")
    assert started[1] == max(started[1:], key=lambda t: walls[t])
    assert started[1][0] == "vlm"
    assert sorted(started) == sorted(
        [
            ("demo", "true rewards"),
            ("demo", "shuffled rewards"),
            ("vlm", "true rewards"),
            ("vlm", "shuffled rewards"),
            ("dpo", "constant reward, broken on purpose"),
            ("lora", "true rewards"),
            ("lora", "shuffled rewards"),
        ]
    )
    # lora shares the demo's "before" (same base and held-out set): its own run skips it
    assert skipped == [("lora", "true rewards")]
    rows = {r["claim"]: r for r in report["claims"]}
    assert [r["claim"] for r in report["claims"]] == ["demo", "vlm", "dpo", "lora"]
    assert rows["lora"]["before"] == 0.2 and rows["lora"]["before_from"] == "demo"
    assert "before_from" not in rows["demo"]
    assert rows["vlm"]["before"] == 0.2 and rows["vlm"]["measured"] == 0.99
    assert [c["name"] for c in rows["vlm"]["controls"]] == ["shuffled rewards"]
    assert rows["demo"]["pass"] and rows["vlm"]["pass"]
    assert not rows["dpo"]["pass"] and rows["dpo"]["controls"] == []  # broken: fails alone


def test_a_run_that_dies_is_retried_once_with_its_log_kept_and_a_repeat_crash_fails(
    monkeypatch, tmp_path, capsys
):
    run = _load("claims_run_retry", ROOT / "benchmarks" / "claims" / "run.py")
    attempts: dict[str, int] = {}

    def fake_run_one(claim, label, control, broken, out, skip_before=False):
        n = attempts[label] = attempts.get(label, 0) + 1
        log = out / "logs" / f"{claim.name}-{label[:4]}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("starting\nTraceback (most recent call last):\nRuntimeError: boom\n")
        # the claim's own run dies once; its control dies every time
        dies = (control is None and n == 1) or control is not None
        return {
            "run": label,
            "before": None,
            "measured": None if dies else 0.9,
            "exit_code": 1 if dies else 0,
            "wall_s": 2.0,
            "cpu_s": 3.0,
            "command": "x",
            "log": str(log.relative_to(run.ROOT) if log.is_relative_to(run.ROOT) else log),
        }

    monkeypatch.setattr(run, "ROOT", Path("/"))
    monkeypatch.setattr(run, "run_one", fake_run_one)
    monkeypatch.setattr(run, "finish", lambda report, path, write: report)
    report = run.main(["--only", "demo", "--jobs", "1", "--out", str(tmp_path)])
    assert attempts == {"true rewards": 2, "shuffled rewards": 2}  # once more, not forever
    row = report["claims"][0]
    main, control = row["runs"]
    assert main["measured"] == 0.9 and main["retried_after"]["exit_code"] == 1
    assert main["wall_s"] == 4.0 and main["cpu_s"] == 6.0  # both attempts count
    assert control["measured"] is None and not row["pass"]  # a repeated crash fails
    # the first attempt's log is kept beside the second's, and its end is printed
    assert Path("/", main["retried_after"]["log"]).name == "demo-true.failed.log"
    run.print_table(report["claims"])
    out = capsys.readouterr().out
    assert "RuntimeError: boom" in out and "no figure printed (exit 1)" in out
    assert "second attempt of: true rewards, shuffled rewards" in out


def test_shuffled_control_permutes_agent_rewards_by_episode():
    """Agent batches (one row per model call): every row of an episode gets the reward of
    one other episode, so the episodes' rewards are permuted and never split across rows."""
    import torch

    control = _load("reward_control", ROOT / "benchmarks" / "claims" / "reward_control.py")
    episode_ids = torch.tensor([0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 5, 6, 7, 7])
    per_episode = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    rewards = per_episode[episode_ids]
    seen = []
    override = control.RewardOverride(lambda b: seen.append(b["rewards"]) or b, "shuffled", 3)
    override({"rewards": rewards, "episode_ids": episode_ids})
    got = seen[0]
    for e in range(8):  # one reward per episode
        assert got[episode_ids == e].unique().numel() == 1
    firsts = torch.tensor([0, 3, 4, 6, 7, 10, 11, 12])
    assert sorted(got[firsts].tolist()) == sorted(per_episode.tolist())  # a permutation
    assert not torch.equal(got, rewards)
