"""Which tests CI leaves out is stated once, generated, and quoted verbatim elsewhere.

``tools/excluded_kinds.py`` builds the sentence from the Makefile's ``NOT_HERE`` markers
and their help in ``pyproject.toml``; README.md, CONTRIBUTING.md, AGENTS.md,
tests/README.md and ``.ci/run`` must hold it as a line of its own. Fast: reads files.
"""

from pathlib import Path

from _load_file import load_file

ROOT = Path(__file__).resolve().parents[1]


excluded = load_file("excluded_kinds", ROOT / "tools" / "excluded_kinds.py")


def test_every_page_quotes_the_generated_sentence_verbatim():
    assert excluded.stale_pages() == [], (
        "quote `python tools/excluded_kinds.py`'s output unchanged on a line of its own"
    )
    assert excluded.main(["--check"]) == 0


def test_the_sentence_names_the_makefile_kinds_with_their_marker_help():
    kinds = excluded.kinds()
    assert kinds == ["gpu", "vllm_cpu", "areal_checkout"]
    text = excluded.sentence()
    assert "are three kinds" in text
    assert "`gpu` needs CUDA;" in text  # the first clause of the marker's help
    for marker in ("archon_matrix", "cluster_faults", "slow", "serial"):
        assert marker not in text


def test_the_skips_ci_allows_are_exactly_the_kinds_left_out():
    plugin = load_file("ci_plugin_kinds", ROOT / "tests" / "_ci_plugin.py")
    assert list(plugin.ALLOWED_SKIP_MARKERS) == excluded.kinds()


def test_a_page_with_a_reworded_sentence_is_reported(tmp_path):
    for page in excluded.QUOTED_IN:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text((ROOT / page).read_text())
    assert excluded.stale_pages(tmp_path) == []
    agents = tmp_path / "AGENTS.md"
    agents.write_text(agents.read_text().replace("are three kinds", "are 3 kinds"))
    assert excluded.stale_pages(tmp_path) == ["AGENTS.md"]


def test_a_new_excluded_kind_in_the_makefile_changes_the_sentence(tmp_path):
    makefile = tmp_path / "Makefile"
    makefile.write_text(
        (ROOT / "Makefile")
        .read_text()
        .replace("not (gpu or vllm_cpu or areal_checkout)", "not (gpu or vllm_cpu)")
    )
    assert excluded.kinds(makefile) == ["gpu", "vllm_cpu"]


def test_check_selection_runs_matrix_and_cluster_faults_and_quick_one_does_not():
    text = (ROOT / "Makefile").read_text()
    lines = {ln.split(":=")[0].strip(): ln.split(":=", 1)[1].strip()
             for ln in text.splitlines() if ":=" in ln and not ln.startswith("\t")}  # fmt: skip
    assert "archon_matrix" in lines["MATRIX"] and "$(MATRIX)" in lines["QUICK_MARKS"]
    # the full check deselects only NOT_HERE: with CHECK_AFTER_TEST, everything the quick
    # selection left out (the matrix and the cluster faults among it)
    assert "MATRIX" not in lines["CHECK_MARKS"].replace("QUICK_MARKS", "")
    assert "not ($(QUICK_MARKS))" in lines["CHECK_MARKS"]
