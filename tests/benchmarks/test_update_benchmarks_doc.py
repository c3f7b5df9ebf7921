"""benchmarks/update_benchmarks_doc.py: every benchmark's table has its block in docs/benchmarks.md,
the README holds none, a refresh replaces exactly the blocks it has results for, and a new
benchmark's section appears with its first results."""
from pathlib import Path

from benchmarks.update_benchmarks_doc import DOC, RESULTS, ROOT, Section, add_sections, block_names, refresh


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


def test_a_new_benchmark_gets_its_section_above_the_given_heading(tmp_path: Path):
    section = Section("new", "### New", "Run by `make new`.", "## Next")
    doc = "## First\n\nprose\n\n## Next\n\nmore\n"
    assert add_sections(doc, tmp_path, (section,)) == (doc, [])  # no results yet: nothing to show
    (tmp_path / "new.md").write_text("| a |\n|---|\n| 1 |\n")
    text, added = add_sections(doc, tmp_path, (section,))
    assert added == ["new"]
    assert text == ("## First\n\nprose\n\n### New\n\nRun by `make new`.\n\n<!-- bench:new -->\n"
                    "<!-- /bench:new -->\n\n## Next\n\nmore\n")
    assert add_sections(text, tmp_path, (section,)) == (text, [])  # once only
    assert "| 1 |" in refresh(text, tmp_path)[0]
    at_end = add_sections("## Only\n", tmp_path, (Section("new", "### New", "How.", "## Absent"),))[0]
    assert at_end == "## Only\n\n### New\n\nHow.\n\n<!-- bench:new -->\n<!-- /bench:new -->\n"


def test_the_sections_to_add_go_above_headings_the_doc_has():
    from benchmarks.update_benchmarks_doc import SECTIONS
    doc = DOC.read_text()
    assert all(f"\n{section.before}\n" in doc for section in SECTIONS)
