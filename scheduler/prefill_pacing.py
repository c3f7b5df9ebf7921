"""Prefill pacing: while sequences decode, an iteration that carries prefill chunks may take at
most `max_slowdown` times a decode-only iteration, and at most `max_stall_s` longer than one.

The token budget alone bounds an iteration's tokens, not its time, and a chunk's time grows with
the prefix it attends to: on a CPU a 512-token chunk deep into an 8,000-token prompt takes
tens of decode steps, and every running stream waits that long for its next token. The pacer
learns two costs from the engine's measured forwards, a decode-only step and a prefill token (its
share of a mixed step beyond the decodes, which tracks the growing prefix), and caps the next
iteration's prefill tokens to what fits in the allowance: (max_slowdown - 1) decode steps, or
max_stall_s, whichever is smaller where both are set. A relative bound gives the prompt about
(max_slowdown - 1) / max_slowdown of the machine; a stall bound in seconds keeps the streams' worst
gap between tokens near one decode step plus it, however fast a decode step is.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillPacer:
    max_slowdown: float  # 0: no relative bound
    min_tokens: int = 16  # a chunk's floor, so a prompt always moves on
    max_stall_s: float = 0.0  # 0: no bound in seconds; with max_slowdown 0 too, the token budget alone
    smoothing: float = 0.3  # weight of the newest measurement in the running averages
    decode_step_s: float | None = None  # a decode-only iteration, lately
    prefill_token_s: float | None = None  # one prefill token's share of an iteration, lately

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """One forward's measured time, with the decodes and prefill tokens it computed."""
        if num_prefill_tokens == 0:
            if num_decodes:
                self.decode_step_s = self._average(self.decode_step_s, seconds)
            return
        decode_s = (self.decode_step_s or 0.0) if num_decodes else 0.0
        if num_decodes and self.decode_step_s is None:
            return  # the decodes' share is not known yet
        self.prefill_token_s = self._average(self.prefill_token_s, max(seconds - decode_s, 0.0) / num_prefill_tokens)

    def max_prefill_tokens(self, num_decoding: int) -> int | None:
        """The most prefill tokens an iteration beside `num_decoding` decoding sequences may
        carry; None: no cap (pacing off, nothing decoding, or the costs not measured yet)."""
        if not num_decoding or not self.decode_step_s or not self.prefill_token_s:
            return None
        allowances = [(self.max_slowdown - 1) * self.decode_step_s] if self.max_slowdown else []
        allowances += [self.max_stall_s] if self.max_stall_s else []
        if not allowances:
            return None
        return max(self.min_tokens, int(min(allowances) / self.prefill_token_s))

    def _average(self, average: float | None, value: float) -> float:
        return value if average is None else average + self.smoothing * (value - average)
