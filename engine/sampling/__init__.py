"""Sampling: one token per row from a batch of logits."""
from engine.sampling.sampler import Sampler, SamplerOutput, prompt_logprobs

__all__ = ["Sampler", "SamplerOutput", "prompt_logprobs"]
