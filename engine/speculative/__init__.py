"""Speculative decoding (--speculative-config): proposers draft tokens for decoding sequences,
the target model verifies them in one pass through every tier it runs on (streamed, sliced,
offloaded layers alike), and each weight pass yields up to k + 1 tokens.

A registry of proposers by method; `Speculator` (speculator.py) drafts into a plan and
`verify` (verify.py, torch) checks the forward's rows. No torch at import: the config reads this.
"""
from __future__ import annotations

from typing import Callable

from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramProposer
from engine.speculative.speculator import Proposer, Speculator

PROPOSERS: dict[str, Callable[[SpeculativeConfig], Proposer]] = {"ngram": NgramProposer}


def create_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method not in PROPOSERS:
        raise ValueError(f"speculative method {config.method!r} has no proposer here; one of "
                         f"{', '.join(PROPOSERS)}")
    return PROPOSERS[config.method](config)


def create_speculator(config: SpeculativeConfig, max_model_len: int) -> Speculator:
    return Speculator(config, create_proposer(config), max_model_len)


__all__ = ["PROPOSERS", "Proposer", "SpeculativeConfig", "Speculator", "create_proposer", "create_speculator"]
