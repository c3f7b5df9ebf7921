"""Measuring this machine: the cost tables of the offloading scheduler and their cache, and the
compute-dtype probe."""
from engine.profiling.cache import (
    ProfileKey,
    load_cached,
    load_or_profile,
    profile_path,
    resolve_cache_dir,
)
from engine.profiling.dtype_probe import auto_dtype, compute_dtype
from engine.profiling.profiler import ProfileGrid, profile_costs

__all__ = ["ProfileGrid", "ProfileKey", "auto_dtype", "compute_dtype", "load_cached", "load_or_profile",
           "profile_costs", "profile_path", "resolve_cache_dir"]
