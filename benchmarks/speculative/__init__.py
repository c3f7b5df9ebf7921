"""Benchmarks of speculative decoding (engine/speculative)."""
