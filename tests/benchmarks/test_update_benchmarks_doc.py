"""benchmarks/update_benchmarks_doc.py: every benchmark's table has its block in docs/benchmarks.md,
the README holds none, and a refresh replaces exactly the blocks it has results for."""
from pathlib import Path

from benchmarks.update_benchmarks_doc import DOC, RESULTS, ROOT, block_names, refresh


def test_every_result_table_has_one_block_in_the_doc():
    names = block_names(DOC.read_text())
    assert len(names) == len(set(names))
    assert {path.stem for path in RESULTS.glob("*.md")} <= set(names)


def test_the_readme_holds_no_benchmark_blocks():
    assert block_names((ROOT / "README.md").read_text()) == []


def test_refresh_replaces_the_blocks_it_has_results_for(tmp_path: Path):
    (tmp_path / "new.md").write_text("| a |\n|---|\n| 2 |\n")
    doc = ("prose kept\n<!-- bench:new -->\n| a |\n|---|\n| 1 |\n<!-- /bench:new -->\n"
           "<!-- bench:missing -->\nold table\n<!-- /bench:missing -->\n")
    text, updated = refresh(doc, tmp_path)
    assert updated == ["new"]
    assert text == ("prose kept\n<!-- bench:new -->\n| a |\n|---|\n| 2 |\n<!-- /bench:new -->\n"
                    "<!-- bench:missing -->\nold table\n<!-- /bench:missing -->\n")
    assert refresh(text, tmp_path)[0] == text
