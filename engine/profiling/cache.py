"""The profile cache: cost tables stored under the key of what they were measured on.

Tables are cached in `<cache_dir>/<16 hex of sha256(key)>.json` holding the `ProfileKey` they
were measured under and the tables. A file is used only when its stored key equals the asked
key field for field, so tables never travel between models, dtypes, devices, CPUs or thread
counts (Neo's own code reused one profile across models).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from engine.config import LoadFormat
from engine.weights import EMBEDDED_MODEL, embedded_gguf_path
from scheduler.planning.cost_model import TableCostModel

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Bump whenever what is measured, or how, changes: files of older versions then miss.
PROFILE_FORMAT_VERSION = 5  # 4: the key names what the linear stages compute from; 5: and the KV format
# tandem's cache root: measured profiles under profiles/, layer files the fit streams from disk
# under offload/ (engine/planning/fit.py)
CACHE_DIR_ENV = "TANDEM_CACHE_DIR"
DEFAULT_CACHE_ROOT = Path("~/.cache/tandem")
PROFILES_SUBDIR = "profiles"
# 64 bits of the key's hash name the file: short, and a collision costs nothing since the stored
# key is compared in full before the tables are used.
DIGEST_HEX_CHARS = 16
CACHE_FILE_MODE = 0o644


# ---- the cache key --------------------------------------------------------------------------
def host_cpu_model() -> str:
    """The host CPU's model name: /proc/cpuinfo's `model name`, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def gpu_name(device: str) -> str:
    """What plays the GPU: the CUDA device's name, or which host-only arrangement."""
    kind = "testbed" if device == "testbed" else torch.device(device).type
    if kind == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    if kind == "testbed":
        return "host-only testbed: a CPU worker thread plays the GPU"
    return f"host {kind}: the GPU's work runs on the engine thread"


def model_identity(model: str | os.PathLike[str], load_format: str) -> tuple[str, int, int, str]:
    """-> (source, bytes, mtime_ns, format) naming the weights: the resolved file or directory with
    its size and latest modification (a directory: config.json and its *.safetensors files), or
    for random weights the preset name with zeros."""
    model = os.fspath(model)
    if load_format == LoadFormat.DUMMY:
        return f"dummy:{model}", 0, 0, str(load_format)
    if model == EMBEDDED_MODEL and load_format in (LoadFormat.AUTO, LoadFormat.GGUF):
        path = embedded_gguf_path()
    else:
        path = Path(model)
    path = path.expanduser().resolve()
    if path.is_dir():
        files = [p for p in (path / "config.json", *sorted(path.glob("*.safetensors"))) if p.is_file()]
        load_format = LoadFormat.SAFETENSORS if load_format == LoadFormat.AUTO else load_format
    elif path.is_file():
        files = [path]
        load_format = LoadFormat.GGUF if load_format == LoadFormat.AUTO and path.suffix == ".gguf" else load_format
    else:
        raise FileNotFoundError(f"{model}: no such model file or directory to key a cost profile on")
    stats = [p.stat() for p in files]
    return str(path), sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0), str(load_format)


@dataclass(frozen=True)
class ProfileKey:
    """Everything a profile's validity depends on; stored beside the tables and compared in full."""

    model: str  # the resolved weights file or directory, or "dummy:<preset>"
    model_bytes: int  # 0 for random weights
    model_mtime_ns: int  # 0 for random weights
    load_format: str
    dtype: str  # "float32", "bfloat16", ...
    device: str  # the engine's device flag: "cpu", "testbed", "cuda:0", ...
    device_name: str
    cpu_model: str
    gpu_threads: int
    cpu_attention_threads: int
    block_size: int
    # What the linear stages compute from: the weight format, and the MLP slicing where it is on
    # (a sliced model's linear stage differs from a resident one's)
    linear_weights: str
    # Kernels change speed between torch releases; a profile from another one would mislead.
    torch_version: str
    kv_cache_dtype: str = "auto"  # how the KV pools store K/V: the attention tables read that format
    format_version: int = PROFILE_FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("gpu_threads", "cpu_attention_threads", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ProfileKey.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def create(cls, *, model: str | os.PathLike[str], load_format: str, dtype: torch.dtype, device: str,
               gpu_threads: int, cpu_attention_threads: int, block_size: int,
               linear_weights: str = "dense", kv_cache_dtype: str = "auto") -> "ProfileKey":
        """The key for serving `model` on this machine with these settings."""
        source, num_bytes, mtime_ns, load_format = model_identity(model, load_format)
        return cls(model=source, model_bytes=num_bytes, model_mtime_ns=mtime_ns, load_format=load_format,
                   dtype=str(dtype).removeprefix("torch."), device=device, device_name=gpu_name(device),
                   cpu_model=host_cpu_model(), gpu_threads=gpu_threads,
                   cpu_attention_threads=cpu_attention_threads, block_size=block_size,
                   linear_weights=linear_weights, torch_version=torch.__version__, kv_cache_dtype=kv_cache_dtype)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def digest(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_HEX_CHARS]


# ---- the cache file -------------------------------------------------------------------------
def cache_root() -> Path:
    """$TANDEM_CACHE_DIR, else ~/.cache/tandem."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_ROOT).expanduser()


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`cache_dir`, else the cache root's profiles/."""
    return Path(cache_dir).expanduser() if cache_dir else cache_root() / PROFILES_SUBDIR


# The scheduler's cost tables; other kinds of profile (the MLP slicing models) sit beside them.
TABLES_KIND = "tables"


def profile_path(key: ProfileKey, cache_dir: str | os.PathLike[str] | None = None, kind: str = TABLES_KIND) -> Path:
    """`<digest>.json` for the cost tables, `<digest>.<kind>.json` for another kind measured under the key."""
    suffix = "" if kind == TABLES_KIND else f".{kind}"
    return resolve_cache_dir(cache_dir) / f"{key.digest}{suffix}.json"


def load_cached(key: ProfileKey, cache_dir: str | os.PathLike[str] | None = None) -> TableCostModel | None:
    """The cached tables for exactly `key`, or None: no file, a file holding another key (a hash
    collision or a copied file), or one that cannot be read (logged)."""
    return _load_kind(key, cache_dir, TABLES_KIND, TableCostModel.from_dict)


def _load_kind(key: ProfileKey, cache_dir: str | os.PathLike[str] | None, kind: str,
               decode: Callable[[Any], T]) -> T | None:
    path = profile_path(key, cache_dir, kind)
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(stored, dict):
            raise ValueError("not a JSON object")
        if stored.get("key") != key.to_dict():
            logger.info("%s: %s measured under another key; not used", path, kind)
            return None
        return decode(stored[kind])
    except FileNotFoundError:
        return None
    # OSError: unreadable; ValueError: bad JSON, bad text or bad tables (TableError); the rest: wrong types
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("%s: unusable %s (%s); profiling again", path, kind, exc)
        return None


def _write_atomically(path: Path, payload: dict[str, Any]) -> None:
    """A reader (another engine starting) sees the old file or the whole new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as temp:
            json.dump(payload, temp, indent=1)
            temp.flush()
            os.fsync(temp.fileno())
        # mkstemp makes it private (0600); tables are not secret and a shared cache dir must read them
        os.chmod(temp_name, CACHE_FILE_MODE)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def load_or_profile(key: ProfileKey, build: Callable[[], TableCostModel],
                    cache_dir: str | os.PathLike[str] | None = None) -> TableCostModel:
    """The cached tables for `key`, else `build()`'s, written to the cache for the next start.
    A cache that cannot be written is logged, not fatal: the tables just measured still serve."""
    return load_or_measure(key, TABLES_KIND, build, TableCostModel.to_dict, TableCostModel.from_dict, cache_dir)


def load_or_measure(key: ProfileKey, kind: str, build: Callable[[], T], encode: Callable[[T], Any],
                    decode: Callable[[Any], T], cache_dir: str | os.PathLike[str] | None = None) -> T:
    """A profile of `kind` (the cost tables, or another kind with its own JSON form) cached under `key`."""
    cached = _load_kind(key, cache_dir, kind, decode)
    if cached is not None:
        logger.info("%s from %s", kind, profile_path(key, cache_dir, kind))
        return cached
    measured = build()
    path = profile_path(key, cache_dir, kind)
    try:
        _write_atomically(path, {"key": key.to_dict(), kind: encode(measured)})
        logger.info("%s cached at %s", kind, path)
    except OSError as exc:
        logger.warning("could not cache the %s at %s (%s); the next start measures again", kind, path, exc)
    return measured
