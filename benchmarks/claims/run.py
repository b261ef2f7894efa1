"""`make claims`: re-measure every learning figure README.md and docs/ state, briefly.

    python benchmarks/claims/run.py                       # all claims, table + JSON
    python benchmarks/claims/run.py --only demo,dpo       # some of them
    python benchmarks/claims/run.py --break demo          # the demo trained on a constant
                                                          # reward: must fail
    python benchmarks/claims/run.py --write-docs          # also docs/claims.json + docs/claims.md
    python benchmarks/claims/run.py --seed-from-commit    # each claim's seed from the commit

What happens, in order:

1. For every claim of ``benchmarks/claims/table.py`` (or ``--only``), its run and then each
   of its controls run as subprocesses: the example script itself with its YAML, a step
   count and its own output folder (``OUT/<claim>/<run>/``; ``OUT`` is ``--out``, default
   ``outputs/claims``; deleted first so that nothing resumes), the controls through the
   script's own control flag, ``benchmarks/claims/reward_control.py`` (rewards) or
   ``benchmarks/claims/label_control.py`` (preference labels); a control skips
   the evaluation before training (same base, seed and held-out set as the claim's own
   run, whose "before" the table shows), and so does the own run of a claim whose
   ``before_from`` claim runs too (the table shows that claim's "before"). Each run's output
   goes to ``OUT/logs/<claim>-<run>.log``; its wall and CPU time (the whole process tree,
   from ``os.wait4``) are recorded. A run that dies before printing its figure is not run
   again: the end of its log is printed and the claim fails (a retry would let a flaky
   crash pass unseen). With ``--seed-from-commit`` every run of a claim gets
   ``seed=<ci_seed(commit, claim)>`` (``benchmarks/claims/seeds.py``), printed and
   recorded with the commit (``make claims`` and ``make check`` pass it: the thresholds
   are calibrated over 5 seeds, ``benchmarks/claims/calibrate.py``); without it the
   YAML's seed.
2. The printed before/after figures are parsed and judged (:func:`judge`): a claim passes
   when its run reaches the threshold, every control stays below it, its "before" is
   within ``base_tolerance`` of the recorded base and its gain over that "before" is at
   least ``threshold - base``.
3. The table (claim, steps, before, measured, threshold, controls, pass, times) is printed
   and written to ``OUT/claims.json`` (``--json``); with ``--write-docs`` also to
   ``docs/claims.json`` and into docs/claims.md's table (``tools/render_claims.py``).
4. Exit status 1 when any claim misses its threshold, any control reaches it, or a run
   fails to print its figure.

``--jobs 3`` (the default) runs three runs side by side, of any claim, the longest (by the
last recorded run, ``docs/claims.json``) first: one run keeps about three quarters of a
core busy (its server and trainer wait on each other), so three fill two cores. Every run
is sized by training steps, so load changes its
wall time but not its length; what it does change, in the asynchronous runs, is how stale
the rollouts of each step are (bounded by the YAML's ``max_head_offpolicyness``), so the
figures are seeded but not bit-for-bit reproducible, in parallel or not; the thresholds
leave room for that.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tools"))

import render_claims  # noqa: E402
from seeds import ci_seed, head_commit  # noqa: E402
from table import (  # noqa: E402
    BY_NAME,
    CLAIMS,
    CONTROL_SCRIPT,
    LABEL_CONTROL_SCRIPT,
    Claim,
    Control,
)

OUT = ROOT / "outputs" / "claims"
RUN_TIMEOUT_S = 900


def run_one(
    claim: Claim,
    label: str,
    control: Control | None,
    broken: bool,
    out: Path,
    skip_before: bool = False,
    seed: int | None = None,
) -> dict:
    """One subprocess run: its parsed figures, wall and CPU seconds, exit status.
    ``skip_before``: no evaluation before training (the claim shares another's "before");
    ``seed``: a ``seed=N`` override (else the YAML's); the run's folder and log carry it."""
    slug = "".join(ch if ch.isalnum() else "-" for ch in label).strip("-")
    if seed is not None:
        slug += f"-seed{seed}"
    run_dir = out / claim.name / slug
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = claim.argv(str(run_dir), trial=slug, control=control is not None or skip_before)
    if seed is not None:
        argv.append(f"seed={seed}")
    if control is not None and control.kind == "args":
        argv += list(control.value)
    if control is not None and control.kind == "wrap":
        argv = [CONTROL_SCRIPT, "--rewards", control.value[0], *argv]
    if control is not None and control.kind == "labels":
        argv = [LABEL_CONTROL_SCRIPT, *argv]
    if broken:
        argv = [CONTROL_SCRIPT, "--rewards", "constant", *argv]
    cmd = [sys.executable, *argv]
    log_path = out / "logs" / f"{claim.name}-{slug}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = t0 + RUN_TIMEOUT_S
        status, usage = 0, None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGTERM)
                time.sleep(10)
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.5)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - t0
    out = log_path.read_text()
    before, after = claim.parse(out)
    return {
        "run": label,
        "seed": seed,
        "command": shlex.join(["python", *argv]).replace(f"{ROOT}/", ""),  # no machine path
        "before": before,
        "measured": after,
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1) if usage else None,
        "log": os.path.relpath(log_path, ROOT),
    }


def plan(claim: Claim, broken: bool, runs: str = "all") -> list[tuple[str, Control | None]]:
    """The runs of one claim: (label, control); none of the controls when ``broken``."""
    label = "constant reward, broken on purpose" if broken else "true rewards"
    todo: list[tuple[str, Control | None]] = [] if runs == "controls" else [(label, None)]
    if runs != "main" and not broken:
        todo += [(c.name, c) for c in claim.controls]
    return todo


def row_of(claim: Claim, results: list[dict], shared_before: dict | None = None) -> dict:
    """The table row of one claim from its runs' results (the claim's own run first);
    ``shared_before``: ``{"claim": name, "before": x}`` when it shares another's."""
    main = {"run": "true rewards", "before": None, "measured": None, "wall_s": 0.0}
    main["cpu_s"] = 0.0
    controls = list(results)
    if results and results[0]["run"] not in {c.name for c in claim.controls}:
        main, controls = results[0], results[1:]
    row = {
        "claim": claim.name,
        "stated": claim.stated,
        "reproduce": claim.reproduce,
        "metric": claim.metric,
        "steps": claim.steps,
        "seed": main.get("seed"),  # None: the YAML's
        "before": main["before"],
        "measured": main["measured"],
        "threshold": claim.threshold,
        "controls": [{"name": c["run"], "measured": c["measured"]} for c in controls],
        "pass": None,
        "wall_s": round(main["wall_s"] + sum(c["wall_s"] for c in controls), 1),
        "cpu_s": round(sum(r["cpu_s"] or 0.0 for r in [main, *controls]), 1),
        "runs": [main, *controls],
    }
    if shared_before is not None:
        row["before"], row["before_from"] = shared_before["before"], shared_before["claim"]
    return judge(row, claim)


def last_walls(path: Path = ROOT / "docs" / "claims.json") -> dict[tuple[str, str], float]:
    """(claim, run) -> wall seconds of the last recorded full run (for the run order)."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {(r["claim"], run["run"]): run["wall_s"] for r in report["claims"] for run in r["runs"]}


def judge(row: dict, claim: Claim) -> dict:
    """``row`` with the claim's threshold, ``pass`` and ``fail_reasons`` (empty on a pass).

    A claim passes when its run printed a figure at or above the threshold, every control
    printed one below it, and, where the claim records its base: the run's "before" is
    within ``base_tolerance`` of that base, and its gain over its own "before" is at least
    the gain the threshold asks of the base (``threshold - base``), so that a "before"
    that drifted up cannot carry the figure over the line.
    """
    t, measured, before = claim.threshold, row["measured"], row["before"]
    reasons = []
    if measured is None:
        reasons.append("the run printed no figure (crashed)")
    elif measured < t:
        reasons.append(f"measured {_pct(measured)} below the threshold {_pct(t)}")
    for c in row["controls"]:
        if c["measured"] is None:
            reasons.append(f"control '{c['name']}' printed no figure (crashed)")
        elif c["measured"] >= t:
            reasons.append(f"control '{c['name']}' reached {_pct(c['measured'])}")
    if claim.base is not None:
        if before is None:
            reasons.append("no 'before' figure to check against the recorded base")
        elif abs(before - claim.base) > claim.base_tolerance + 1e-9:
            reasons.append(
                f"before {_pct(before)} is more than {_pct(claim.base_tolerance)} from the "
                f"recorded base {_pct(claim.base)}"
            )
        elif measured is not None and measured - before < t - claim.base - 1e-9:
            reasons.append(
                f"gain {_pct(measured - before)} over its before is below the "
                f"{_pct(t - claim.base)} the threshold asks of the base"
            )
    return {
        **row,
        "threshold": t,
        "base": claim.base,
        "pass": not reasons,
        "fail_reasons": reasons,
    }


def rejudge(path: str) -> dict:
    """A recorded report with the table's current thresholds applied (no run)."""
    report = json.loads(Path(path).read_text())
    report["claims"] = [judge(r, BY_NAME[r["claim"]]) for r in report["claims"]]
    report["passed"] = all(r["pass"] for r in report["claims"])
    return report


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _progress(claim: Claim, r: dict) -> str:
    return (
        f"  {claim.name:<13} {r['run']:<26} before {_pct(r['before']):>6} "
        f"after {_pct(r['measured']):>6}  exit {r['exit_code']}  "
        f"wall {r['wall_s']:.0f} s  cpu {r['cpu_s']} s  ({r['log']})"
    )


def _log_tail(res: dict, lines: int = 40) -> str:
    """The last ``lines`` lines of a failed run's log, indented, for the CI output."""
    text = (ROOT / res["log"]).read_text(errors="replace").splitlines()
    # tqdm's carriage-return updates: only the last state of each line
    tail = [ln.rsplit("\r", 1)[-1] for ln in text[-lines:]]
    head = f"  --- {res['run']}: no figure printed (exit {res['exit_code']}); end of {res['log']}:"
    return "\n".join([head, *("    | " + ln for ln in tail), "  ---"])


def print_table(rows: list[dict]) -> None:
    head = f"{'claim':<13} {'steps':>5} {'before':>7} {'measured':>8} {'threshold':>9}  "
    head += f"{'controls (must stay below)':<40} {'pass':<4} {'wall':>6} {'cpu':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        ctl = ", ".join(f"{c['name']} {_pct(c['measured'])}" for c in r["controls"]) or "-"
        crashed = [x["run"] for x in r["runs"] if x.get("crashed")]
        print(
            f"{r['claim']:<13} {r['steps']:>5} {_pct(r['before']):>7} {_pct(r['measured']):>8} "
            f"{'>= ' + _pct(r['threshold']):>9}  {ctl:<40} {'yes' if r['pass'] else 'NO':<4} "
            f"{r['wall_s']:>5.0f}s {r['cpu_s']:>5.0f}s"
        )
        if crashed:
            print(f"{'':<13} crashed (not retried; log ends above): {', '.join(crashed)}")
        for reason in r.get("fail_reasons", []):
            print(f"{'':<13} fails: {reason}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated claim names")
    parser.add_argument(
        "--break",
        dest="broken",
        default="",
        help="comma-separated claim names trained on a constant reward (must then fail)",
    )
    parser.add_argument(
        "--out", default=str(OUT), help="run folders and logs (one invocation at a time each)"
    )
    parser.add_argument("--json", default=None, help="default: OUT/claims.json")
    parser.add_argument(
        "--jobs", type=int, default=3, help="runs side by side (any claim's, longest first)"
    )
    parser.add_argument(
        "--write-docs", action="store_true", help="also write docs/claims.json and docs/claims.md"
    )
    parser.add_argument(
        "--seed-from-commit",
        action="store_true",
        help="each claim's runs get seed=<ci_seed(commit, claim)> (benchmarks/claims/seeds.py); "
        "off by default until calibrate.py's thresholds exist",
    )
    parser.add_argument(
        "--commit", default=None, help="with --seed-from-commit: this commit id instead of HEAD"
    )
    parser.add_argument(
        "--runs",
        choices=("all", "main", "controls"),
        default="all",
        help="calibration: only the claims' own runs, or only their controls",
    )
    parser.add_argument(
        "--run-timeout", type=float, default=900.0, help="seconds before a run is killed"
    )
    parser.add_argument(
        "--rejudge",
        metavar="JSON",
        help="no runs: apply the current thresholds to a recorded report (e.g. after "
        "changing one), then print / write it as a run would",
    )
    ns = parser.parse_args(argv)
    out = Path(ns.out).resolve()
    ns.json = ns.json or str(out / "claims.json")
    names = [n for n in ns.only.split(",") if n] or [c.name for c in CLAIMS]
    broken = {n for n in ns.broken.split(",") if n}
    if ns.write_docs and (ns.only or broken or ns.runs != "all"):
        parser.error("--write-docs records a full run: not with --only, --break, --runs")
    global RUN_TIMEOUT_S
    RUN_TIMEOUT_S = ns.run_timeout
    unknown = [n for n in [*names, *broken] if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown claims {unknown}; known: {sorted(BY_NAME)}")
    if ns.rejudge:
        return finish(rejudge(ns.rejudge), ns.rejudge, ns.write_docs)
    commit = None
    seeds: dict[str, int | None] = dict.fromkeys(names)
    if ns.seed_from_commit:
        commit = ns.commit or head_commit()
        seeds = {n: ci_seed(commit, n) for n in names}
        for n in names:
            print(f"claim {n}: seed {seeds[n]} (sha256 of '{commit}:{n}')", flush=True)
    t0, c0 = time.monotonic(), os.times()
    # every run of every claim is its own job; the longest (last recorded wall) start
    # first, so that no long run is left to run alone at the end
    tasks = [(n, *r) for n in names for r in plan(BY_NAME[n], n in broken, ns.runs)]
    walls = last_walls()
    order = sorted(tasks, key=lambda t: -walls.get((t[0], t[1]), 1e9))
    # claims whose "before" comes from another claim's run in this invocation
    borrows = {n: BY_NAME[n].before_from for n in names if BY_NAME[n].before_from in names}

    def run_task(task: tuple[str, str, Control | None]) -> dict:
        name, label, control = task
        own_run = control is None
        args = (BY_NAME[name], label, control, name in broken and own_run, out)
        kwargs = {"skip_before": own_run and name in borrows}
        if seeds[name] is not None:
            kwargs["seed"] = seeds[name]
        res = run_one(*args, **kwargs)
        print(_progress(BY_NAME[name], res), flush=True)
        if res["measured"] is None:
            # the run died before printing its figure: its log's end is shown and the
            # claim fails; it is not run again
            res["crashed"] = True
            print(_log_tail(res), flush=True)
        return res

    with ThreadPoolExecutor(max_workers=ns.jobs) as pool:
        done = dict(zip(order, pool.map(run_task, order)))
    own = {t[0]: done[t] for t in tasks if t[2] is None}
    rows = [
        row_of(
            BY_NAME[n],
            [done[t] for t in tasks if t[0] == n],
            {"claim": borrows[n], "before": own[borrows[n]]["before"]} if n in borrows else None,
        )
        for n in names
    ]
    c1 = os.times()
    report = {
        "command": "make claims",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_end": [round(x, 1) for x in os.getloadavg()],
        "wall_s": round(time.monotonic() - t0, 1),
        "cpu_s": round(
            c1.children_user + c1.children_system - c0.children_user - c0.children_system, 1
        ),
        "passed": all(r["pass"] for r in rows),
        "seed_commit": commit,  # None: every run used its YAML's seed
        "jobs": ns.jobs,
        "broken": sorted(broken),
        "claims": rows,
    }
    return finish(report, ns.json, ns.write_docs)


def finish(report: dict, json_path: str, write_docs: bool) -> int:
    """Print the table, write the JSON (and docs), return the exit status."""
    rows = report["claims"]
    print()
    print_table(rows)
    print(
        f"\nall claims: wall {report['wall_s']:.0f} s, CPU {report['cpu_s']:.0f} s "
        f"(load average at the end {report['load_average_end']})"
    )
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    print(f"JSON: {json_path}")
    if write_docs:
        (ROOT / "docs" / "claims.json").write_text(json.dumps(report, indent=2) + "\n")
        render_claims.write_page(ROOT / "docs" / "claims.md", report)
        print("wrote docs/claims.json and docs/claims.md's table")
    if not report["passed"]:
        print("make claims: FAILED: " + ", ".join(r["claim"] for r in rows if not r["pass"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
