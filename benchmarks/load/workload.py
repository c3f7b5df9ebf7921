"""What a serving benchmark sends and when: request lengths and arrival processes.

Lengths come from one of three sources: synthetic targets (fixed, or uniform within a relative
spread as Neo section 5.1 does with +-10%), a lognormal mix described in a small JSON file under
`configs/workloads/`, or a CSV replay of (arrival time, input tokens, output tokens). Arrivals are
a separate choice (`Load`), so the same lengths can be driven at several rates or concurrencies.
Every random draw comes from a seeded numpy Generator; lengths and arrivals use separate streams,
so changing the rate never changes which requests are sent.
"""
from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

WORKLOADS_DIR = Path(__file__).resolve().parents[2] / "configs" / "workloads"
LOAD_KINDS = ("rate", "concurrency", "burst", "replay")

# Seed-stream tags: one independent stream per purpose, derived from the user's single seed.
_LENGTHS_STREAM, _ARRIVALS_STREAM = 1, 2

# Column names accepted in a replay CSV (lower-cased); the Azure LLM inference traces use the
# TIMESTAMP / ContextTokens / GeneratedTokens spelling.
_ARRIVAL_COLUMNS = ("arrival_time", "arrival", "timestamp", "time")
_INPUT_COLUMNS = ("input_tokens", "prompt_tokens", "input", "contexttokens")
_OUTPUT_COLUMNS = ("output_tokens", "completion_tokens", "output", "generatedtokens")
_LONG_FRACTION = re.compile(r"(\.\d{6})\d+")


class WorkloadError(ValueError):
    """A workload file or replay CSV that cannot be used; the message names the file and field."""


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: token counts, and its arrival offset when the load is open-loop."""
    index: int
    num_input_tokens: int
    num_output_tokens: int
    arrival_s: float | None = None


@dataclass(frozen=True)
class LogNormal:
    """A lognormal length distribution given by its median and sigma, clipped to [min, max]."""
    median: float
    sigma: float
    min: int = 1
    max: int = 1 << 20

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        draws = rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)
        return np.clip(np.rint(draws), self.min, self.max).astype(int)


@dataclass(frozen=True)
class WorkloadFile:
    """A named lognormal mix of input and output lengths (see `configs/workloads/*.json`)."""
    name: str
    description: str
    input: LogNormal
    output: LogNormal
    endpoint: str = "completions"

    @classmethod
    def load(cls, name_or_path: str) -> "WorkloadFile":
        path = Path(name_or_path)
        if not path.suffix:
            path = WORKLOADS_DIR / f"{name_or_path}.json"
        if not path.is_file():
            known = sorted(p.stem for p in WORKLOADS_DIR.glob("*.json"))
            raise WorkloadError(f"no workload '{name_or_path}' (a .json file, or one of {known})")
        try:
            raw = json.loads(path.read_text())
            return cls(name=raw.get("name", path.stem), description=raw.get("description", ""),
                       input=LogNormal(**raw["input"]), output=LogNormal(**raw["output"]),
                       endpoint=raw.get("endpoint", "completions"))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise WorkloadError(f"{path}: expected input/output objects with median, sigma, min, max "
                                f"({type(exc).__name__}: {exc})") from None


def synthetic_lengths(n: int, input_len: int, output_len: int, spread: float, seed: int,
                      output_spread: float | None = None) -> list[RequestSpec]:
    """n requests with lengths uniform in [(1-spread)*target, (1+spread)*target], drawn independently;
    outputs may have a spread of their own."""
    output_spread = spread if output_spread is None else output_spread
    for value in (spread, output_spread):
        if not 0.0 <= value < 1.0:
            raise WorkloadError(f"length spread must be in [0, 1), got {value}")
    rng = np.random.default_rng([seed, _LENGTHS_STREAM])

    def draw(target: int, spread: float) -> np.ndarray:
        low, high = max(1, round(target * (1 - spread))), max(1, round(target * (1 + spread)))
        return rng.integers(low, high, size=n, endpoint=True)

    inputs, outputs = draw(input_len, spread), draw(output_len, output_spread)
    return [RequestSpec(i, int(a), int(b)) for i, (a, b) in enumerate(zip(inputs, outputs))]


def workload_lengths(workload: WorkloadFile, n: int, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng([seed, _LENGTHS_STREAM])
    inputs, outputs = workload.input.sample(rng, n), workload.output.sample(rng, n)
    return [RequestSpec(i, int(a), int(b)) for i, (a, b) in enumerate(zip(inputs, outputs))]


def read_replay_csv(path: str | Path, limit: int | None = None) -> list[RequestSpec]:
    """Rows of (arrival time, input tokens, output tokens), arrivals made relative to the first.

    A header row is optional; without one the columns are taken in that order. Arrival times are
    seconds (any float) or ISO-8601 datetimes. Rows are sorted by arrival time.
    """
    path = Path(path)
    try:
        rows = list(csv.reader(path.read_text().splitlines()))
    except OSError as exc:
        raise WorkloadError(f"cannot read replay CSV {path}: {exc}") from None
    rows = [r for r in rows if r and any(cell.strip() for cell in r)]
    if not rows:
        raise WorkloadError(f"{path}: no rows")
    columns = (0, 1, 2)
    has_header = not _is_number(rows[0][-1])
    if has_header:
        header = [cell.strip().lower() for cell in rows[0]]
        columns = tuple(_find_column(path, header, names) for names in
                        (_ARRIVAL_COLUMNS, _INPUT_COLUMNS, _OUTPUT_COLUMNS))
        rows = rows[1:]
    parsed = []
    for line, row in enumerate(rows, start=2 if has_header else 1):
        try:
            arrival = _parse_time(row[columns[0]])
            num_input, num_output = int(float(row[columns[1]])), int(float(row[columns[2]]))
        except (IndexError, ValueError) as exc:
            raise WorkloadError(f"{path}:{line}: expected arrival time, input tokens, output tokens "
                                f"({exc})") from None
        if num_input < 1 or num_output < 1:
            raise WorkloadError(f"{path}:{line}: token counts must be positive, got {num_input}, {num_output}")
        parsed.append((arrival, num_input, num_output))
    parsed.sort(key=lambda row: row[0])
    parsed = parsed[:limit] if limit else parsed
    start = parsed[0][0]
    return [RequestSpec(i, a, b, t - start) for i, (t, a, b) in enumerate(parsed)]


def _find_column(path: Path, header: list[str], names: tuple[str, ...]) -> int:
    for name in names:
        if name in header:
            return header.index(name)
    raise WorkloadError(f"{path}: header {header} has none of the columns {list(names)}")


def _is_number(cell: str) -> bool:
    try:
        float(cell)
        return True
    except ValueError:
        return False


def _parse_time(cell: str) -> float:
    cell = cell.strip()
    if _is_number(cell):
        return float(cell)
    # traces carry up to 7 fractional digits; Python before 3.11 parses at most 6
    return datetime.fromisoformat(_LONG_FRACTION.sub(r"\1", cell)).timestamp()


@dataclass(frozen=True)
class Load:
    """How requests arrive: Poisson at `value` req/s, a closed loop of `value` clients, all at once
    (burst), or the replay CSV's own times (rescaled to `value` req/s on average when given)."""
    kind: str
    value: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in LOAD_KINDS:
            raise WorkloadError(f"load kind must be one of {LOAD_KINDS}, got '{self.kind}'")
        if self.kind in ("rate", "concurrency") and (self.value is None or self.value <= 0):
            raise WorkloadError(f"{self.kind} must be positive, got {self.value}")

    @property
    def label(self) -> str:
        if self.kind == "burst":
            return "all at once"
        if self.kind == "replay" and self.value is None:
            return "replay"
        if self.kind == "concurrency":
            return f"{self.value:g} client" + ("s" if self.value != 1 else "")
        return f"{self.value:g} req/s"

    @property
    def concurrency(self) -> int | None:
        """Clients in the closed loop; None for the open-loop kinds."""
        return int(self.value) if self.kind == "concurrency" else None

    def schedule(self, specs: list[RequestSpec], seed: int) -> list[RequestSpec]:
        """The specs with `arrival_s` set for open-loop kinds (closed loop leaves them None)."""
        if self.kind == "concurrency":
            return [RequestSpec(s.index, s.num_input_tokens, s.num_output_tokens) for s in specs]
        if self.kind == "burst":
            times = np.zeros(len(specs))
        elif self.kind == "rate":
            times = poisson_arrivals(len(specs), self.value, seed)
        else:
            times = replay_arrivals([s.arrival_s for s in specs], self.value)
        return [RequestSpec(s.index, s.num_input_tokens, s.num_output_tokens, float(t))
                for s, t in zip(specs, times)]


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Arrival offsets of a Poisson process at `rate` req/s, the first at 0 (inf rate: all at 0)."""
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng([seed, _ARRIVALS_STREAM])
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0  # a run starts with its first request, not with an idle wait
    return np.cumsum(gaps)


def replay_arrivals(times: list[float | None], rate: float | None) -> np.ndarray:
    """The trace's own offsets, or scaled so the mean rate over the trace is `rate` req/s."""
    if any(t is None for t in times):
        raise WorkloadError("replay arrivals need a replay CSV (its rows carry the arrival times)")
    offsets = np.asarray(times, dtype=float) - times[0]
    if rate is None or len(offsets) < 2 or offsets[-1] == 0:
        return offsets
    return offsets * ((len(offsets) - 1) / offsets[-1] / rate)
