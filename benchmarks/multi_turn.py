"""`make bench-multi-turn`'s entry to the multi-turn chat benchmark (server/bench/multi_turn.py):
the same flags, results under benchmarks/results/ by default."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the repository's packages first

from server.bench.multi_turn import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(default_output=ROOT / "benchmarks" / "results" / "multi_turn.json"))
