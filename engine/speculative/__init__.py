"""Speculative decoding (--speculative-config): proposers draft tokens for decoding sequences,
the target model verifies them in one pass through every tier it runs on (streamed, sliced,
offloaded layers alike), and each weight pass yields up to k + 1 tokens.

A registry of proposers by method; `Speculator` (speculator.py) drafts into a plan and
`verify` (verify.py, torch) checks the forward's rows. No torch at import: the config reads this.
"""
from __future__ import annotations

from typing import Any, Callable

from engine.speculative_config import SpeculativeConfig
from engine.speculative.ngram import NgramProposer
from engine.speculative.speculator import Proposer, Speculator


def _draft_model(config: SpeculativeConfig, target: Any) -> Proposer:
    from engine.speculative.draft_model import DraftModelProposer  # torch: only where one is asked for

    return DraftModelProposer(config, target)


# method -> factory(config, target): `target` (draft_model.Target) says what a proposer must share
PROPOSERS: dict[str, Callable[[SpeculativeConfig, Any], Proposer]] = {
    "ngram": lambda config, target: NgramProposer(config), "draft_model": _draft_model}


def create_proposer(config: SpeculativeConfig, target: Any) -> Proposer:
    if config.method not in PROPOSERS:
        raise ValueError(f"speculative method {config.method!r} has no proposer here; one of "
                         f"{', '.join(PROPOSERS)}")
    return PROPOSERS[config.method](config, target)


def create_speculator(config: SpeculativeConfig, target: Any) -> Speculator:
    return Speculator(config, create_proposer(config, target), target.max_model_len)


__all__ = ["PROPOSERS", "Proposer", "SpeculativeConfig", "Speculator", "create_proposer", "create_speculator"]
