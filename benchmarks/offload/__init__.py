"""Keeping weights off the GPU: streaming layers from host memory and disk, `tandem plan` against the
engine, MLP slicing, hot experts, the thread split and the fit against every fixed configuration."""
