"""Refresh docs/benchmarks.md's tables from benchmarks/results/*.md.

Each benchmark writes its table to results/<name>.md; docs/benchmarks.md holds a block
`<!-- bench:<name> -->` ... `<!-- /bench:<name> -->` for each, replaced here verbatim.
Blocks whose result file is missing are left as they are; the prose around them is not touched.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.S)


def refresh(doc: str, results: Path = RESULTS) -> tuple[str, list[str]]:
    """`doc` with each block whose results/<name>.md exists replaced by that table; the names replaced."""
    updated = []

    def replace(match: re.Match) -> str:
        path = results / f"{match['name']}.md"
        if not path.is_file():
            return match[0]
        updated.append(match["name"])
        return f"{match[1]}{path.read_text().strip()}\n{match[4]}"

    return BLOCK.sub(replace, doc), updated


def block_names(doc: str) -> list[str]:
    """The benchmarks `doc` has a block for, in order."""
    return [match["name"] for match in BLOCK.finditer(doc)]


def main() -> int:
    text, updated = refresh(DOC.read_text())
    DOC.write_text(text)
    print(f"{DOC.relative_to(ROOT)}: refreshed {', '.join(updated) or 'nothing'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
