"""tandem's benchmarks; run them from the repository root (see each script's docstring)."""
