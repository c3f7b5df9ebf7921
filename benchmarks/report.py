"""Where a benchmark's results go: its JSON and, beside it, the markdown table that
benchmarks/update_readme.py puts in the README."""
from __future__ import annotations

import json
from pathlib import Path


def write_results(json_path: Path, result, markdown: str) -> None:
    """json_path (results/<name>.json) and results/<name>.md."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    json_path.with_suffix(".md").write_text(markdown)
