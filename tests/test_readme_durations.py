"""README.md's stated durations are the last recorded fresh-clone run's, within 25%.

The table "Fresh-clone runs: durations and CPU kind" of docs/benchmarks.md gets a row per
fresh-clone run; README.md's "The two commands" table states a time for `make demo`,
`make test` and `.ci/run`. Each must be within 25% of the last row that measured that
command. Fast: reads files.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("`make demo`", "`make test`", "`.ci/run`")
TOLERANCE = 0.25


def _seconds(text: str) -> float | None:
    """'4 min 9 s' / '37 min' / '2,239 s' / '249 s' -> seconds; '-' -> None."""
    text = text.strip().replace(",", "")
    m = re.fullmatch(r"(?:(\d+(?:\.\d+)?) min)?\s*(?:(\d+(?:\.\d+)?) s)?", text)
    if text in ("", "-") or m is None or not any(m.groups()):
        return None
    return float(m.group(1) or 0) * 60 + float(m.group(2) or 0)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def recorded(benchmarks: str) -> dict[str, float]:
    """command -> seconds of the last row of the fresh-clone table that measured it."""
    start = benchmarks.index("<!-- fresh-clone-runs:")
    lines = benchmarks[start:].splitlines()[1:]
    rows = [ln for ln in lines[lines.index(next(ln for ln in lines if ln.startswith("|"))) :]]
    table = []
    for ln in rows:
        if not ln.startswith("|"):
            break
        table.append(_cells(ln))
    head, body = table[0], table[2:]
    last = {}
    for row in body:  # in order: a later row wins
        for cmd in COMMANDS:
            s = _seconds(row[head.index(cmd)])
            if s is not None:
                last[cmd] = s
    return last


def stated(readme: str) -> dict[str, float]:
    """command -> the seconds README.md's two-commands table states for it."""
    section = readme[readme.index("## The two commands") :]
    section = section[: section.index("\n## ", 1)]
    out = {}
    for ln in section.splitlines():
        if ln.startswith("|") and _cells(ln)[0] in COMMANDS:
            out[_cells(ln)[0]] = _seconds(_cells(ln)[-1])
    return out


def test_duration_parser_reads_the_forms_the_docs_use():
    assert _seconds("4 min 9 s") == 249
    assert _seconds("37 min") == 2220
    assert _seconds("2,239 s") == 2239
    assert _seconds("-") is None and _seconds("about an hour") is None


def test_readme_durations_are_within_25_percent_of_the_last_fresh_clone_run():
    readme = stated((ROOT / "README.md").read_text())
    runs = recorded((ROOT / "docs" / "benchmarks.md").read_text())
    assert set(readme) == set(COMMANDS), readme
    assert set(runs) == set(COMMANDS), runs
    for cmd in COMMANDS:
        assert readme[cmd] is not None, f"README.md states no time for {cmd}"
        off = abs(readme[cmd] - runs[cmd]) / runs[cmd]
        assert off <= TOLERANCE, (
            f"README.md says {cmd} takes {readme[cmd]:.0f} s; the last fresh-clone run "
            f"recorded in docs/benchmarks.md took {runs[cmd]:.0f} s ({100 * off:.0f}% off): "
            "update README.md's table"
        )


def test_a_slower_recorded_run_makes_the_readme_figure_stale():
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    marker = "<!-- fresh-clone-runs:"
    start = bench.index(marker)
    table_end = bench.index("\n\n", bench.index("| ---", start))
    readme = stated((ROOT / "README.md").read_text())
    slow = int(2 * readme["`.ci/run`"])  # twice what README states: a slower run
    slower = f"\n| 2099-01-01 | 0000000 | test | 2 | - | - | {slow} s | a slower run |"
    runs = recorded(bench[:table_end] + slower + bench[table_end:])
    assert runs["`.ci/run`"] == slow
    assert abs(readme["`.ci/run`"] - slow) / slow > TOLERANCE
