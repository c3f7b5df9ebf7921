"""Where a benchmark's results go: its JSON and, beside it, the markdown table that
benchmarks/update_benchmarks_doc.py puts in docs/benchmarks.md."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"  # beside this package, read by update_benchmarks_doc


def write_results(json_path: Path, result, markdown: str) -> None:
    """json_path (results/<name>.json) and results/<name>.md."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    json_path.with_suffix(".md").write_text(markdown)


def run_interleaved(configs: dict[str, Any], reps: int, measure: Callable[[Any], dict]) -> dict[str, list[dict]]:
    """Each configuration measured once per repetition, in order on even repetitions and in reverse
    on odd ones, so drift over the run favours none; each result echoed on stderr."""
    samples: dict[str, list[dict]] = {name: [] for name in configs}
    for rep in range(reps):
        for name in (list(configs) if rep % 2 == 0 else list(reversed(configs))):
            samples[name].append(measure(configs[name]))
            print(name, rep, samples[name][-1], file=sys.stderr, flush=True)
    return samples


def median_rows(samples: dict[str, list[dict]], keys: Iterable[str]) -> dict[str, dict]:
    """Per configuration: its first run's fields, `keys` replaced by their medians over its runs."""
    rows = {}
    for name, runs in samples.items():
        row = dict(runs[0])
        for key in keys:
            row[key] = statistics.median(r[key] for r in runs)
        rows[name] = row
    return rows
