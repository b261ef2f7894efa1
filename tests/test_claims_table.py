"""docs/claims.md's learning-claims table is the rendering of docs/claims.json (`make
claims`); the runner judges, seeds and fails crashed runs as docs/claims.md says.

Fast: reads files, runs fakes. The claims themselves run in `make claims`
(benchmarks/claims/run.py).
"""

import json
from pathlib import Path

import pytest
from _load_file import load_file

ROOT = Path(__file__).resolve().parents[1]


render_claims = load_file("render_claims", ROOT / "tools" / "render_claims.py")
table = load_file("claims_table", ROOT / "benchmarks" / "claims" / "table.py")


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((ROOT / "docs" / "claims.json").read_text())


def test_claims_page_table_matches_docs_claims_json(report):
    page = (ROOT / "docs" / "claims.md").read_text()
    assert render_claims.current_block(page) == render_claims.render(report), (
        "docs/claims.md's claims table differs from docs/claims.json: run "
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
    run = load_file("claims_run_judge", ROOT / "benchmarks" / "claims" / "run.py")
    for row in report["claims"]:
        ok = row["measured"] is not None and row["measured"] >= row["threshold"]
        ok = ok and all(
            c["measured"] is not None and c["measured"] < row["threshold"] for c in row["controls"]
        )
        claim = table.BY_NAME[row["claim"]]
        if claim.base is not None:
            ok = ok and abs(row["before"] - claim.base) <= claim.base_tolerance + 1e-9
        assert row["pass"] == ok, row["claim"]
        assert run.judge(row, claim)["pass"] == row["pass"], row["claim"]
    assert report["passed"] == all(r["pass"] for r in report["claims"])


def test_render_claims_check_fails_on_an_edited_table(tmp_path, report):
    readme = tmp_path / "claims.md"
    text = (ROOT / "docs" / "claims.md").read_text()
    first = report["claims"][0]
    edited = text.replace(
        f"**{100 * first['measured']:.1f}%**", f"**{100 * first['measured'] + 1:.1f}%**", 1
    )
    assert edited != text
    readme.write_text(edited)
    rc = render_claims.main(["--check", "--page", str(readme)])
    assert rc == 1
    readme.write_text(text)
    assert render_claims.main(["--check", "--page", str(readme)]) == 0


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
        else:  # DPO/RW: no evaluator settings; their control shuffles the training labels
            assert [c.kind for c in claim.controls] == ["labels"]


def test_runs_are_scheduled_one_by_one_and_assembled_back_into_their_claims(monkeypatch):
    run = load_file("claims_run", ROOT / "benchmarks" / "claims" / "run.py")
    started, skipped = [], []

    def fake_run_one(claim, label, control, broken, out, skip_before=False, seed=None):
        started.append((claim.name, label))
        if skip_before:
            skipped.append((claim.name, label))
        passed = control is None and not broken
        return {
            "run": label,
            "before": claim.base if control is None and not skip_before else None,
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
    assert rows["lora"]["before"] == 0.215 and rows["lora"]["before_from"] == "demo"
    assert "before_from" not in rows["demo"]
    assert rows["vlm"]["before"] == 0.0 and rows["vlm"]["measured"] == 0.99
    assert [c["name"] for c in rows["vlm"]["controls"]] == ["shuffled rewards"]
    assert rows["demo"]["pass"] and rows["vlm"]["pass"]
    assert not rows["dpo"]["pass"] and rows["dpo"]["controls"] == []  # broken: fails alone


def test_a_run_that_dies_is_not_retried_its_log_end_is_printed_and_the_claim_fails(
    monkeypatch, tmp_path, capsys
):
    run = load_file("claims_run_no_retry", ROOT / "benchmarks" / "claims" / "run.py")
    attempts: dict[str, int] = {}

    def fake_run_one(claim, label, control, broken, out, skip_before=False, seed=None):
        attempts[label] = attempts.get(label, 0) + 1
        log = out / "logs" / f"{claim.name}-{label[:4]}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("starting\nTraceback (most recent call last):\nRuntimeError: boom\n")
        dies = control is None  # the claim's own run dies (once would do: never run again)
        return {
            "run": label,
            "before": None,
            "measured": None if dies else 0.1,
            "exit_code": 1 if dies else 0,
            "wall_s": 2.0,
            "cpu_s": 3.0,
            "command": "x",
            "log": str(log),
        }

    monkeypatch.setattr(run, "ROOT", Path("/"))
    monkeypatch.setattr(run, "run_one", fake_run_one)
    monkeypatch.setattr(run, "finish", lambda report, path, write: report)
    report = run.main(["--only", "demo", "--jobs", "1", "--out", str(tmp_path)])
    assert attempts == {"true rewards": 1, "shuffled rewards": 1}  # nothing runs twice
    row = report["claims"][0]
    main, control = row["runs"]
    assert main["crashed"] and main["measured"] is None and not control.get("crashed")
    assert not row["pass"] and "the run printed no figure (crashed)" in row["fail_reasons"]
    out = capsys.readouterr().out
    assert "RuntimeError: boom" in out and "no figure printed (exit 1)" in out
    run.print_table(report["claims"])
    assert "crashed (not retried; log ends above): true rewards" in capsys.readouterr().out


def _row(before, measured, controls=()):
    return {
        "before": before,
        "measured": measured,
        "controls": [{"name": n, "measured": m} for n, m in controls],
    }


def test_judge_checks_threshold_controls_before_against_base_and_gain():
    run = load_file("claims_run_judge2", ROOT / "benchmarks" / "claims" / "run.py")
    demo = table.BY_NAME["demo"]  # threshold 0.70, base 0.215, tolerance 0.05
    ok = run.judge(_row(0.215, 0.80, [("shuffled rewards", 0.20)]), demo)
    assert ok["pass"] and ok["fail_reasons"] == [] and ok["base"] == 0.215
    # a control that learnt too
    bad = run.judge(_row(0.215, 0.80, [("shuffled rewards", 0.70)]), demo)
    assert not bad["pass"] and "control 'shuffled rewards' reached 70.0%" in bad["fail_reasons"]
    # a "before" that is not the recorded base (another base, a broken evaluation)
    drifted = run.judge(_row(0.40, 0.80, [("shuffled rewards", 0.2)]), demo)
    assert not drifted["pass"] and "from the recorded base" in drifted["fail_reasons"][0]
    # within the tolerance, but the gain over its own "before" is short of what the
    # threshold asks of the base (0.70 - 0.215 = 48.5 points): 0.72 - 0.26 = 46 points
    short = run.judge(_row(0.26, 0.72, [("shuffled rewards", 0.2)]), demo)
    assert not short["pass"] and "gain 46.0%" in short["fail_reasons"][0]
    # no "before" at all
    assert not run.judge(_row(None, 0.9, [("shuffled rewards", 0.2)]), demo)["pass"]
    # a crashed control fails the claim
    crashed = run.judge(_row(0.215, 0.9, [("shuffled rewards", None)]), demo)
    assert crashed["fail_reasons"] == ["control 'shuffled rewards' printed no figure (crashed)"]


def test_ci_seed_is_a_stable_hash_of_commit_and_claim():
    seeds = load_file("claims_seeds", ROOT / "benchmarks" / "claims" / "seeds.py")
    import hashlib

    commit = "4c14d19" + "0" * 33
    s = seeds.ci_seed(commit, "demo")
    digest = hashlib.sha256(f"{commit}:demo".encode()).digest()
    assert s == int.from_bytes(digest[:8], "big") % 2**31
    assert seeds.ci_seed(commit, "demo") == s  # the same commit, the same seed
    assert 0 <= s < 2**31
    others = {seeds.ci_seed(commit, c.name) for c in table.CLAIMS}
    assert len(others) == len(table.CLAIMS)  # each claim its own
    assert seeds.ci_seed("1" * 40, "demo") != s  # another commit, another seed
    with pytest.raises(ValueError):
        seeds.ci_seed("", "demo")
    head = seeds.head_commit()
    assert len(head) == 40 and int(head, 16) >= 0


def test_seed_from_commit_reaches_every_run_of_a_claim_and_the_report(monkeypatch, capsys):
    run = load_file("claims_run_seeded", ROOT / "benchmarks" / "claims" / "run.py")
    got = []

    def fake_run_one(claim, label, control, broken, out, skip_before=False, seed=None):
        got.append((claim.name, label, seed))
        argv = claim.argv("x", trial="t") + ([f"seed={seed}"] if seed is not None else [])
        return {"run": label, "seed": seed, "before": claim.base, "exit_code": 0,
                "measured": 0.9 if control is None else 0.1, "wall_s": 1.0, "cpu_s": 1.0,
                "command": " ".join(argv), "log": "x"}  # fmt: skip

    monkeypatch.setattr(run, "run_one", fake_run_one)
    monkeypatch.setattr(run, "finish", lambda report, path, write: report)
    commit = "a" * 40
    args = ["--only", "demo,dpo", "--jobs", "1", "--out", "/nonexistent-claims-out"]
    report = run.main([*args, "--seed-from-commit", "--commit", commit])
    seeds = load_file("claims_seeds2", ROOT / "benchmarks" / "claims" / "seeds.py")
    want = {"demo": seeds.ci_seed(commit, "demo"), "dpo": seeds.ci_seed(commit, "dpo")}
    assert sorted(got) == sorted(
        [("demo", "true rewards", want["demo"]), ("demo", "shuffled rewards", want["demo"]),
         ("dpo", "true rewards", want["dpo"]), ("dpo", "shuffled labels", want["dpo"])]
    )  # fmt: skip
    assert report["seed_commit"] == commit
    assert {r["claim"]: r["seed"] for r in report["claims"]} == want
    assert f"claim demo: seed {want['demo']} (sha256 of '{commit}:demo')" in capsys.readouterr().out
    # off by default: the YAMLs' seeds, nothing recorded
    got.clear()
    report = run.main(args)
    assert {s for _, _, s in got} == {None} and report["seed_commit"] is None


def test_run_one_passes_the_seed_and_wraps_label_controls(monkeypatch, tmp_path):
    run = load_file("claims_run_argv", ROOT / "benchmarks" / "claims" / "run.py")
    seen = []

    class FakePopen:
        def __init__(self, cmd, **kw):
            seen.append(cmd)
            kw["stdout"].write('{"heldout_before": {"preference_accuracy": 0.24}, '
                               '"heldout_after": {"preference_accuracy": 0.3}}\n')  # fmt: skip
            self.pid = 0

    monkeypatch.setattr(run.subprocess, "Popen", FakePopen)
    monkeypatch.setattr(run.os, "wait4", lambda pid, flags: (1, 0, None))
    dpo = table.BY_NAME["dpo"]
    res = run.run_one(dpo, "shuffled labels", dpo.controls[0], False, tmp_path, seed=7)
    cmd = seen[0]
    assert cmd[1] == "benchmarks/claims/label_control.py" and cmd[2] == dpo.script
    assert "seed=7" in cmd and res["seed"] == 7
    assert res["before"] == 0.24 and res["measured"] == 0.3
    assert "seed7" in res["log"]  # each seed its own log and folder


def test_label_control_swaps_a_seeded_half_of_the_training_pairs_only():
    import datasets

    control = load_file("label_control", ROOT / "benchmarks" / "claims" / "label_control.py")
    n = 200
    ds = datasets.Dataset.from_dict(
        {"chosen_ids": [[i, 1] for i in range(n)], "rejected_ids": [[i, 0] for i in range(n)],
         "chosen_loss_mask": [[1, 1]] * n, "rejected_loss_mask": [[1, 0]] * n}
    )  # fmt: skip
    out = control.shuffle_labels(ds, seed=3)
    swapped = [row["chosen_ids"][1] == 0 for row in out]
    assert 70 < sum(swapped) < 130  # about half
    for row, s in zip(out, swapped):  # every chosen_X column moved with its rejected_X
        assert row["chosen_loss_mask"] == ([1, 0] if s else [1, 1])
        assert row["rejected_ids"][1] == (1 if s else 0)
    again = control.shuffle_labels(ds, seed=3)
    assert [r["chosen_ids"] for r in again] == [r["chosen_ids"] for r in out]  # seeded
    plain = datasets.Dataset.from_dict({"input_ids": [[1], [2]]})
    assert control.shuffle_labels(plain, seed=3) is plain  # not a preference dataset
    assert control.seed_of(["a=1", "seed=5", "seed=9"]) == 9 and control.seed_of([]) == 1


def test_calibration_rule_puts_the_threshold_ten_points_from_both():
    cal = load_file("claims_calibrate", ROOT / "benchmarks" / "claims" / "calibrate.py")
    ok = cal.verdict(0.60, [0.80, 0.75, 0.90], [0.30, 0.45])
    assert ok["ok"] and ok["true_min"] == 0.75 and ok["control_max"] == 0.45
    assert ok["suggested"] == 0.6  # the midpoint of 0.45 and 0.75
    # the multi-turn case of the issue: controls up to 52.7%, true runs down to 64.5%
    mt = cal.verdict(0.58, [0.645, 0.766], [0.527, 0.438])
    assert not mt["ok"] and mt["suggested"] is None and "stronger" in mt["why"]
    # separable, but the threshold is too close to the controls: move it
    move = cal.verdict(0.50, [0.90, 0.85], [0.45])
    assert not move["ok"] and move["suggested"] == 0.65 and "move the threshold" in move["why"]
    # a crashed run: no calibration
    crash = cal.verdict(0.60, [0.9, None], [0.1])
    assert not crash["ok"] and crash["missing"] == 1


def test_calibrate_runs_each_claim_and_control_per_seed_without_retry(monkeypatch, tmp_path):
    cal = load_file("claims_calibrate_main", ROOT / "benchmarks" / "claims" / "calibrate.py")
    calls = []

    def fake_run_one(claim, label, control, broken, out, skip_before=False, seed=None):
        calls.append((claim.name, label, seed))
        crash = label == "shuffled labels" and seed == 2
        return {"run": label, "seed": seed, "before": 0.24, "exit_code": 1 if crash else 0,
                "measured": None if crash else (0.9 + seed / 100 if control is None else 0.2),
                "wall_s": 1.0, "cpu_s": 1.0, "command": "x", "log": str(tmp_path / "l.log")}  # fmt: skip

    (tmp_path / "l.log").write_text("Traceback\nboom\n")
    monkeypatch.setattr(cal.claims_run, "run_one", fake_run_one)
    monkeypatch.setattr(cal.claims_run, "ROOT", Path("/"))
    out_json = tmp_path / "c.json"
    args = ["--only", "dpo", "--seeds", "2", "--jobs", "1", "--out", str(tmp_path)]
    rc = cal.main([*args, "--json", str(out_json)])
    assert sorted(calls) == sorted(
        [("dpo", "true rewards", 1), ("dpo", "true rewards", 2),
         ("dpo", "shuffled labels", 1), ("dpo", "shuffled labels", 2)]
    )  # fmt: skip
    report = json.loads(out_json.read_text())
    row = report["claims"][0]
    assert row["true"] == {"1": 0.91, "2": 0.92} and row["true_min"] == 0.91
    assert row["controls"] == {"shuffled labels": {"1": 0.2, "2": None}}
    assert rc == 1 and not row["ok"] and row["missing"] == 1  # the crash is not rerun
    assert "| `dpo` | 15 | 1, 2 |" in cal.render(report)


def test_rejudge_takes_each_claims_runs_from_the_last_file_and_refuses_stale_steps(tmp_path):
    cal = load_file("claims_calibrate_rejudge", ROOT / "benchmarks" / "claims" / "calibrate.py")

    def report(commit, rows):
        return {"command": f"calibrate {commit}", "commit": commit, "machine": "m",
                "wall_s": 10.0, "cpu_s": 20.0, "claims": rows}  # fmt: skip

    def row(claim, steps, true, control):
        runs = [{"run": "true rewards", "seed": s, "before": 0.2, "measured": true} for s in (1, 2)]
        runs += [{"run": claim.controls[0].name, "seed": s, "measured": control} for s in (1, 2)]
        return {"claim": claim.name, "steps": steps, "runs": runs}

    first = [row(c, c.steps, 0.9, 0.1) for c in cal.CLAIMS]
    dpo = cal.BY_NAME["dpo"]
    later = [row(dpo, dpo.steps, 0.95, 0.5)]  # dpo calibrated again later
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report("aaaa", first)))
    b.write_text(json.dumps(report("bbbb", later)))
    got = cal.rejudge([str(a), str(b)], 0.10)
    rows = {r["claim"]: r for r in got["claims"]}
    assert rows["dpo"]["true_min"] == 0.95 and rows["dpo"]["control_max"] == 0.5
    assert rows["demo"]["true_min"] == 0.9  # from the first file
    assert got["commit"] == "aaaa,bbbb" and got["wall_s"] == 20.0
    stale = [row(dpo, dpo.steps + 1, 0.95, 0.5)]
    b.write_text(json.dumps(report("bbbb", stale)))
    with pytest.raises(SystemExit, match="dpo"):
        cal.rejudge([str(a), str(b)], 0.10)


def test_docs_calibration_meets_the_rule_with_todays_thresholds_and_steps():
    """docs/claims_calibration.json (5 seeds a claim) judged with the table as it is now:
    every threshold at least 10 points from the true runs' lowest and the controls'
    highest, at the steps the claims run."""
    cal = load_file("claims_calibrate_docs", ROOT / "benchmarks" / "claims" / "calibrate.py")
    got = cal.rejudge([str(ROOT / "docs" / "claims_calibration.json")], cal.MARGIN)
    bad = [(r["claim"], r["why"]) for r in got["claims"] if not r["ok"]]
    assert not bad
    assert all(len(r["seeds"]) >= 5 for r in got["claims"])


def test_shuffled_control_permutes_agent_rewards_by_episode():
    """Agent batches (one row per model call): every row of an episode gets the reward of
    one other episode, so the episodes' rewards are permuted and never split across rows."""
    import torch

    control = load_file("reward_control", ROOT / "benchmarks" / "claims" / "reward_control.py")
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
