"""`make bench-long-prompt`'s entry to the long-prompt benchmark (server/bench/long_prompt.py): the
same flags, results under benchmarks/results/ by default."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the repository's packages first

from server.bench.long_prompt import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(default_output=ROOT / "benchmarks" / "results" / "long_prompt.json"))
