"""Sampling: one token per row from a batch of logits."""
from engine.sampling.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput"]
