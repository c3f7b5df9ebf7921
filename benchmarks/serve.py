"""`make bench`'s entry to the serving benchmark (server/bench/serve.py, also `tandem bench serve`):
the same flags, results under benchmarks/results/ by default."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the repository's packages first

from server.bench.serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(default_output=ROOT / "benchmarks" / "results" / "serve.json"))
