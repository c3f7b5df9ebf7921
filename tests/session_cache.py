"""The session's profile cache (tests/conftest.py sets it up) and profile caches of a test's own
that share its measurements but not its expert statistics."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

# engine.profiling.cache.CACHE_DIR_ENV, named here so that the scheduler tests' collection needs no torch
CACHE_DIR_ENV = "TANDEM_CACHE_DIR"
# engine.offload.experts.store.EXPERT_STATS_KIND: <digest>.experts.json
EXPERT_STATS_SUFFIX = ".experts.json"


def session_cache_dir() -> Path:
    """The session's profiles: engine.profiling.cache's profiles/ under the cache root."""
    return Path(os.environ[CACHE_DIR_ENV]) / "profiles"


def _measured(directory: Path) -> list[Path]:
    """The profiles in `directory` that measure this machine: every kind but the expert statistics."""
    return [path for path in directory.glob("*.json") if not path.name.endswith(EXPERT_STATS_SUFFIX)]


@contextlib.contextmanager
def own_expert_statistics(directory: Path):
    """A profile cache in `directory` that starts with what the session has measured (cost tables,
    thread profiles, slicing costs) and gives back what was measured in it, but keeps its expert
    statistics to itself: a run's statistics choose the next run's first hot sets, so a test that
    saw another's would depend on their order."""
    session = session_cache_dir()
    session.mkdir(parents=True, exist_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    for path in _measured(session):
        shutil.copy2(path, directory / path.name)
    try:
        yield directory
    finally:
        for path in _measured(directory):
            if not (session / path.name).exists():
                partial = session / f".{path.name}.partial"
                shutil.copy2(path, partial)
                os.replace(partial, session / path.name)  # whole or not at all, for a server reading it
