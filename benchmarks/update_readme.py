"""Refresh README.md's benchmark tables from benchmarks/results/*.md.

Each benchmark writes its table to results/<name>.md; the README holds a block
`<!-- bench:<name> -->` ... `<!-- /bench:<name> -->` for each, replaced here verbatim.
Blocks whose result file is missing are left as they are.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.S)


def refresh(readme: str) -> tuple[str, list[str]]:
    updated = []

    def replace(match: re.Match) -> str:
        path = RESULTS / f"{match['name']}.md"
        if not path.is_file():
            return match[0]
        updated.append(match["name"])
        return f"{match[1]}{path.read_text().strip()}\n{match[4]}"

    return BLOCK.sub(replace, readme), updated


def main() -> int:
    readme = ROOT / "README.md"
    text, updated = refresh(readme.read_text())
    readme.write_text(text)
    print(f"README.md: refreshed {', '.join(updated) or 'nothing'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
