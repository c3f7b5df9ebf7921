"""`tandem serve` with faults planted, for tests/server/test_faults.py: run as
`python tests/server/faulty_server.py serve FLAGS...`.

- A request whose prompt holds SAMPLING_FAULT_TOKEN makes sampling raise for its row (the batch's
  sampling is retried row by row, so only that request should fail).
- A request whose prompt holds LOOP_FAULT_TOKEN makes the engine loop itself raise as it hands out
  the request's first token (outside any step: the loop dies, /health turns 503, the server exits 1).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLING_FAULT_TOKEN = 31337
LOOP_FAULT_TOKEN = 31338


def plant_faults() -> None:
    from engine.async_engine import AsyncEngine
    from engine.sampling.sampler import Sampler

    sample_batch = Sampler._sample_batch

    def faulty_sample_batch(self, logits, seqs):
        if any(SAMPLING_FAULT_TOKEN in seq.prompt_token_ids for seq in seqs):
            raise RuntimeError("a fault planted in sampling")
        return sample_batch(self, logits, seqs)

    deliver = AsyncEngine._deliver

    def faulty_deliver(self, outputs):
        if any(LOOP_FAULT_TOKEN in output.prompt_token_ids for output in outputs):
            raise RuntimeError("a fault planted in the engine loop")
        deliver(self, outputs)

    Sampler._sample_batch = faulty_sample_batch
    AsyncEngine._deliver = faulty_deliver


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    plant_faults()
    from server.cli import main

    sys.exit(main(sys.argv[1:]))
