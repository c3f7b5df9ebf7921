"""Draft-model drafts: a second, smaller model sharing the target's tokenizer, resident (INT4 by
default) with its own small KV pool, proposes k tokens greedily, one decode step of its own per
token, batched over the sequences it drafts for.

Its KV follows each sequence by its tokens: what it computed stays valid as far as the sequence's
tokens still match what it drafted (the accepted drafts), and the next proposal first catches up
on the rest (the prompt at first, then the token the verify drew) in one chunk. Blocks come from
its own pool: a sequence that finds none free gets no drafts, and a finished one's are freed.
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from engine.model_config import ConfigError
from engine.speculative.budget import ProposerCosts
from engine.speculative_config import SpeculativeConfig
from scheduler.block_pool import BlockPool, blocks_for
from scheduler.iteration_plan import IterationPlan, ScheduledSeq
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence

logger = logging.getLogger(__name__)

DRAFT_POOL_TOKENS = 32768  # the draft model's KV pool: 32 sequences of 1,024 tokens
DRAFT_BLOCK_SIZE = 16
DECODE_ROW_TOKENS = 8  # a catch-up this short runs as decode rows (the CPU GEMV's row block), longer a prefill
_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass(frozen=True)
class Target:
    """What a proposer must share with the model it drafts for."""

    vocab_size: int
    tokenizer: Any  # engine.text.Tokenizer or None
    dtype: Any  # torch.dtype
    device: str  # the engine's --device
    max_model_len: int
    seed: int


@dataclass
class DraftState:
    """One target sequence as the draft model holds it."""

    sequence: weakref.ref
    proxy: Sequence  # its tokens as the draft model saw and drafted them, its blocks in the draft pool
    num_computed: int = 0
    drafts: list[int] = field(default_factory=list)

    def sync(self, tokens: list[int]) -> None:
        """Keep the computed tokens that still match `tokens` (accepted drafts), all but the last:
        its row gives the first draft. Take `tokens`."""
        seen = self.proxy.prompt_token_ids
        common = 0
        limit = min(self.num_computed, len(tokens) - 1, len(seen))
        while common < limit and seen[common] == tokens[common]:
            common += 1
        self.num_computed = common
        self.proxy.prompt_token_ids = list(tokens)
        self.drafts = []


class DraftModelProposer:
    name = "draft_model"

    def __init__(self, config: SpeculativeConfig, target: Target) -> None:
        from engine.runtime import ModelRunner
        from engine.weights import create_loader

        loader = create_loader(config.model, config.load_format, seed=target.seed)
        _check_shared_tokenizer(config.model, loader, target)
        self.max_model_len = min(target.max_model_len, loader.config.max_position_embeddings or target.max_model_len)
        num_blocks = DRAFT_POOL_TOKENS // DRAFT_BLOCK_SIZE
        device = "cpu" if target.device in ("cpu", "testbed") else target.device  # INT4 runs on cpu or cuda
        self.runner = ModelRunner(loader.config, loader, dtype=target.dtype, device=device, num_blocks=num_blocks,
                                  block_size=DRAFT_BLOCK_SIZE, max_model_len=self.max_model_len, seed=target.seed,
                                  linear_method="int4" if config.quantization == "int4" else "dense")
        self.pool = BlockPool(num_blocks, DRAFT_BLOCK_SIZE)
        self._states: dict[int, DraftState] = {}
        self._warm_up()
        logger.info("draft model %s: %d layers, %s weights, a KV pool of %d tokens", config.model,
                    loader.config.num_layers, config.quantization, DRAFT_POOL_TOKENS)

    def close(self) -> None:
        self.runner.close()

    def propose(self, requests: list[tuple[Sequence, int]], costs: ProposerCosts) -> list[list[int]]:
        self._release_finished()
        live = [(index, self._ready(seq, k), k) for index, (seq, k) in enumerate(requests) if k > 0]
        live = [(index, state, k) for index, state, k in live if state is not None]
        if live:
            self._catch_up([state for _, state, _ in live], costs)
            for step in range(1, max(k for _, _, k in live)):
                self._decode([state for _, state, k in live if k > step], costs)  # each has `step` drafts
        drafts = [[] for _ in requests]
        for index, state, k in live:
            drafts[index] = state.drafts[:k]
        return drafts

    def catch_up_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` it has not computed, where more than a decode step's rows catch up on."""
        state = self._states.get(id(seq))
        computed = state.num_computed if state is not None and state.sequence() is seq else 0
        missing = seq.num_tokens - computed
        return missing if missing > DECODE_ROW_TOKENS else 0

    def _ready(self, seq: Sequence, num_drafts: int) -> DraftState | None:
        """Its state synced to its tokens, with blocks for them and its drafts; None where the
        pool or the draft model's context has no room."""
        tokens = seq.all_token_ids
        if len(tokens) + num_drafts > self.max_model_len:
            return None
        state = self._states.get(id(seq))
        if state is None or state.sequence() is not seq:
            state = self._states[id(seq)] = DraftState(weakref.ref(seq), Sequence(seq.seq_id, [], _GREEDY))
        state.sync(tokens)
        needed = blocks_for(len(tokens) + num_drafts, DRAFT_BLOCK_SIZE) - len(state.proxy.block_ids)
        if needed > 0:
            if not self.pool.can_allocate(needed):
                return None
            state.proxy.block_ids.extend(self.pool.allocate(needed))
        return state

    def _catch_up(self, states: list[DraftState], costs: ProposerCosts | None) -> None:
        """Every token each has not computed, its last row giving the first draft. Once caught up
        with a sequence (after its prompt) a few tokens remain: the accepted drafts' last and the
        token the verify drew. Those run as decode rows (as a verify's do), priced as a step; a
        prompt runs as a prefill chunk, priced by its tokens (paid once a sequence)."""
        shares = [self._catch_up_share(state) for state in states]
        plan = IterationPlan(prefills=[share for share in shares if share.num_new_tokens > DECODE_ROW_TOKENS],
                             decodes=[share for share in shares if share.num_new_tokens <= DECODE_ROW_TOKENS])
        by_seq = {id(share.sequence): state for share, state in zip(shares, states)}
        seconds = self._run(plan, [by_seq[id(share.sequence)] for share in plan.scheduled])
        if costs is not None and plan.prefills:
            costs.observe_catch_up(sum(share.num_new_tokens for share in plan.prefills), seconds)
        elif costs is not None:
            costs.observe_step(len(states), seconds)

    @staticmethod
    def _catch_up_share(state: DraftState) -> ScheduledSeq:
        start, num_new = state.num_computed, state.proxy.num_tokens - state.num_computed
        if 1 < num_new <= DECODE_ROW_TOKENS:  # a verify-shaped share: its rows' logits come back
            tokens = state.proxy.all_token_ids[start + 1:]
            return ScheduledSeq(state.proxy, start, num_new, samples=False, draft_token_ids=tuple(tokens))
        return ScheduledSeq(state.proxy, start, num_new)

    def _decode(self, states: list[DraftState], costs: ProposerCosts | None) -> None:
        """One more draft each, from the last one."""
        if states:
            shares = [ScheduledSeq(state.proxy, state.proxy.num_tokens - 1, 1) for state in states]
            seconds = self._run(IterationPlan(decodes=shares), states)
            if costs is not None:
                costs.observe_step(len(states), seconds)

    def _run(self, plan: IterationPlan, states: list[DraftState]) -> float:
        """`states` in `plan.scheduled` order; each takes its share's greedy token as a draft. The
        seconds it took."""
        start = time.perf_counter()
        output = self.runner.execute(plan)
        seconds = time.perf_counter() - start
        sampled = iter(output.sampled.token_ids)
        verified = iter(output.verify_logits)
        for state, share in zip(states, plan.scheduled):
            token = next(sampled) if share.samples else int(next(verified)[-1].argmax())
            state.num_computed = state.proxy.num_tokens
            state.proxy.prompt_token_ids.append(token)
            state.drafts.append(token)
        return seconds

    def _warm_up(self) -> None:
        """One catch-up of each kind and a decode, so that no first call's set-up is priced."""
        proxy = Sequence("draft-warm-up", list(range(DECODE_ROW_TOKENS + 2)), _GREEDY)
        proxy.block_ids.extend(self.pool.allocate(blocks_for(DECODE_ROW_TOKENS * 3, DRAFT_BLOCK_SIZE)))
        state = DraftState(weakref.ref(proxy), proxy)
        self._catch_up([state], None)
        state.proxy.prompt_token_ids.extend([1, 2])
        state.num_computed -= 1  # the last draft's row has not run
        self._catch_up([state], None)
        self._decode([state], None)
        self.pool.free(reversed(proxy.block_ids))

    def _release_finished(self) -> None:
        for key in [key for key, state in self._states.items()
                    if state.sequence() is None or state.sequence().finished]:
            self.pool.free(reversed(self._states.pop(key).proxy.block_ids))


def _check_shared_tokenizer(model: str, loader, target: Target) -> None:
    """ConfigError unless the draft model reads and writes the target's token ids."""
    if loader.config.vocab_size != target.vocab_size:
        raise ConfigError(f"--speculative-config model {model}: its vocabulary has {loader.config.vocab_size} "
                          f"tokens, the target's {target.vocab_size}; a draft model must share the target's tokenizer")
    if target.tokenizer is None or not loader.tokenizer_source:
        return
    from engine.text import Tokenizer

    draft_vocab = Tokenizer.from_source(loader.tokenizer_source).hf_tokenizer.get_vocab()
    if draft_vocab != target.tokenizer.hf_tokenizer.get_vocab():
        raise ConfigError(f"--speculative-config model {model}: its tokenizer's vocabulary differs from the "
                          f"target's; a draft model must share the target's tokenizer")
