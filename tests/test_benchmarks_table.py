"""docs/benchmarks.md's headline table is the rendering of docs/benchmarks.json
(tools/render_benchmarks.py), every row's source exists, and rows whose source is a
benchmark's JSON take their figures from it.

Fast: reads files, no benchmark runs.
"""

import json
from pathlib import Path

import pytest
from _load_file import load_file

ROOT = Path(__file__).resolve().parents[1]


render_benchmarks = load_file("render_benchmarks", ROOT / "tools" / "render_benchmarks.py")


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((ROOT / "docs" / "benchmarks.json").read_text())


def test_headline_table_matches_docs_benchmarks_json(report):
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert page.count(render_benchmarks.BEGIN) == 1 and page.count(render_benchmarks.END) == 1
    assert render_benchmarks.current_block(page) == render_benchmarks.render(report), (
        "docs/benchmarks.md's headline table differs from docs/benchmarks.json: run "
        "`python tools/render_benchmarks.py`"
    )


def test_every_row_has_its_fields_and_an_existing_source(report):
    ids = [r["id"] for r in report["rows"]]
    assert len(ids) == len(set(ids))
    for row in report["rows"]:
        for key in ("title", "section", "command", "compared", "figures", "result", "target",
                    "met", "machine", "date", "commit", "source"):  # fmt: skip
            assert key in row, (row["id"], key)
        if render_benchmarks.is_json_source(row["source"]):
            # the figures are read from the JSON, not copied into the record
            assert any("from" in f for f in row["figures"].values()), row["id"]
    assert render_benchmarks.missing_sources(report) == []


def test_a_missing_source_file_or_section_is_reported(report):
    rows = [dict(r) for r in report["rows"][:2]]
    rows[0]["source"] = "docs/no_such_benchmark.json"
    rows[1]["source"] = "docs/benchmarks.md#no-such-section"
    missing = render_benchmarks.missing_sources({"rows": rows})
    assert len(missing) == 2
    assert "no such file" in missing[0] and "no such section" in missing[1]


def test_json_sourced_rows_follow_their_json(tmp_path, report, monkeypatch):
    """Rerunning a benchmark rewrites its JSON; the rendered row changes with it."""
    row = next(r for r in report["rows"] if r["source"] == "docs/real_model_vs_vllm.json")
    data = json.loads((ROOT / row["source"]).read_text())
    data["side_by_side"][0]["builtin_over_vllm"]["sampled"] = 1.23
    fake = tmp_path / "docs" / "real_model_vs_vllm.json"
    fake.parent.mkdir()
    fake.write_text(json.dumps(data))
    monkeypatch.setattr(render_benchmarks, "ROOT", tmp_path)
    lines = render_benchmarks.render_table({"rows": [row]})
    assert "**1.23x**" in lines[2] and "| yes |" in lines[2]  # the target (>= 1x) now met


def test_check_fails_on_an_edited_table(tmp_path, report):
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    page = tmp_path / "benchmarks.md"
    edited = text.replace("**4.25x**", "**4.35x**", 1)
    assert edited != text
    page.write_text(edited)
    assert render_benchmarks.main(["--check", "--page", str(page)]) == 1
    page.write_text(text)
    assert render_benchmarks.main(["--check", "--page", str(page)]) == 0


def test_the_embedded_plots_exist():
    block = render_benchmarks.current_block((ROOT / "docs" / "benchmarks.md").read_text())
    for path in render_benchmarks.PLOTS.values():
        assert (ROOT / path).is_file(), path
        assert path.removeprefix("docs/") in block, path
