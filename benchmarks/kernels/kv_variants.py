"""Quantized KV cache variants, built or not, emulated and measured like the built formats (issue 49 item 3).

A float16-cache engine on the embedded model runs `accuracy.py`'s teacher-forced held text; for each
variant its prefill attention takes the fp32 K/V through the variant's round trip (what its pool would
give back, as a quantized layout's `as_stored` does). "16-bit" parts (the first token, the first block:
attention sinks; with an own block, each query's own block up to itself, KIVI's residual) stay fp16.
Emulated, the built int8, int4 and k8v4 give the engine's rows (test_kv_variants.py checks it).

    python -m benchmarks.kernels.kv_variants [--window-tokens 64 512] [--variant INT4 ...]

Writes benchmarks/results/kv_variants.json and .md, which `update_benchmarks_doc.py` puts in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import engine  # noqa: F401  (before torch)
import torch
import torch.nn.functional as F

from benchmarks.kernels.accuracy import (HELD_TEXT, KV_REFERENCE, Comparison, comparison, held_windows,
                                         teacher_forced, teacher_forced_engine)
from benchmarks.report import RESULTS_DIR, write_results
from engine.kv.layouts import DenseLayout
from engine.model import llama
from kernels.kv_quant import GROUP_SIZE, SCALE_BYTES, dequantize, quantize, rotate

MODEL = "smollm2-135m"
HEAD_DIM = 64  # the embedded model's: bytes below are a token's per KV head
WINDOW_TOKENS = (64, 512)
SINK_TOKENS = 16  # the first block
CLIP_RATIOS = [1.0 - 0.05 * step for step in range(10)]  # of a group's half-range about its centre
RESULTS = RESULTS_DIR / "kv_variants.json"


def grouped(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """x [..., n] through kv_quant's codes in groups of `group` along the last dim: a group smaller than
    GROUP_SIZE is repeated to fill one, which keeps its range and so its scale and codes."""
    if group == GROUP_SIZE:
        return dequantize(*quantize(x, bits))
    groups = x.unflatten(-1, (-1, group))  # [..., n / group, group]
    filled = groups.repeat(*[1] * (groups.dim() - 1), GROUP_SIZE // group).flatten(-2)
    return dequantize(*quantize(filled, bits)).unflatten(-1, (-1, GROUP_SIZE))[..., :group].flatten(-2)


def clipped(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Each group's range shrunk about its centre by the ratio of CLIP_RATIOS with the least squared error."""
    groups = x.unflatten(-1, (-1, group))
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    centre, half_range = (high + low) / 2, (high - low) / 2
    best, best_error = groups, torch.full_like(half_range, float("inf"))
    for ratio in CLIP_RATIOS:
        bound = ratio * half_range
        trial = grouped(groups.clamp(centre - bound, centre + bound).flatten(-2), bits, group)
        trial = trial.unflatten(-1, (-1, group))
        error = (trial - groups).square().sum(-1, keepdim=True)
        best, best_error = torch.where(error < best_error, trial, best), torch.minimum(error, best_error)
    return best.flatten(-2)


def per_channel(rows: torch.Tensor, bits: int, block_tokens: int) -> torch.Tensor:
    """rows [num_tokens, kv_heads, head_dim]: one scale (and minimum) per channel per block of tokens."""
    blocks = rows.unflatten(0, (-1, block_tokens)).movedim(1, -1)  # [blocks, kv_heads, head_dim, block_tokens]
    return grouped(blocks, bits, block_tokens).movedim(-1, 1).flatten(0, 1)


@dataclass(frozen=True)
class Codes:
    """How a variant stores one side (keys or values) of a token; 16 bits: fp16, unquantized."""
    bits: int
    group_channels: int = GROUP_SIZE
    rotated: bool = False  # each 64-channel group times the Hadamard matrix, as the built formats' keys
    block_tokens: int = 0  # per-channel scales over blocks of this many tokens; 0: per token
    clip: bool = False

    @property
    def bytes_per_token(self) -> float:
        if self.bits == 16:
            return HEAD_DIM * 2
        scales_per_token = HEAD_DIM / (self.block_tokens or self.group_channels) * (2 if self.bits == 4 else 1)
        return HEAD_DIM * self.bits / 8 + scales_per_token * SCALE_BYTES

    def round_trip(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 rows [num_tokens, kv_heads, head_dim] as the pool would give them back."""
        if self.bits == 16:
            return rows.half().float()
        x = rotate(rows) if self.rotated else rows
        if self.block_tokens:
            y = per_channel(x, self.bits, self.block_tokens)
        else:
            y = (clipped if self.clip else grouped)(x, self.bits, self.group_channels)
        return rotate(y) if self.rotated else y


@dataclass(frozen=True)
class Variant:
    key: Codes
    value: Codes
    sink_tokens: int = 0  # the first tokens kept 16-bit
    own_block_tokens: int = 0  # each query sees its own block up to itself 16-bit; 0: no

    @property
    def bytes_per_token(self) -> float:
        """Keys and values, not counting a 16-bit part's own pool."""
        return self.key.bytes_per_token + self.value.bytes_per_token

    def stored(self, rows: torch.Tensor, codes: Codes) -> torch.Tensor:
        out = codes.round_trip(rows)
        out[:self.sink_tokens] = rows[:self.sink_tokens].half().float()
        return out


INT8, INT4, FP16 = Codes(8, rotated=True), Codes(4, rotated=True), Codes(16)  # built keys rotate
V8, V4 = Codes(8), Codes(4)
PER_CHANNEL, PER_CHANNEL_ROTATED = Codes(4, block_tokens=16), Codes(4, rotated=True, block_tokens=16)
PER_CHANNEL_32, PER_CHANNEL_32_ROTATED = Codes(4, block_tokens=32), Codes(4, rotated=True, block_tokens=32)
CLIPPED = Codes(4, clip=True)
VARIANTS = {  # name: how it stores keys and values; the first six rows (INT8, INT4, K8V4) are built
    "INT8": Variant(INT8, V8),
    "INT4": Variant(INT4, V4),
    "INT4 keys, 16-bit values": Variant(INT4, FP16),
    "16-bit keys, INT4 values": Variant(FP16, V4),
    "INT4 keys, INT8 values": Variant(INT4, V8),
    "K8V4: INT8 keys, INT4 values": Variant(INT8, V4),
    "INT4, 32-channel groups": Variant(Codes(4, 32, rotated=True), Codes(4, 32)),
    "INT4, keys in 32-channel groups": Variant(Codes(4, 32, rotated=True), V4),
    "INT4, values in 32-channel groups": Variant(INT4, Codes(4, 32)),
    "INT4, values rotated too": Variant(INT4, Codes(4, rotated=True)),
    "INT4, each group's range clipped for least squared error": Variant(Codes(4, rotated=True, clip=True), CLIPPED),
    "INT4, per-channel key scales over 16-token blocks": Variant(PER_CHANNEL, V4),
    "INT4, the same, keys rotated": Variant(PER_CHANNEL_ROTATED, V4),
    "INT4, per-channel rotated key scales over 32-token blocks": Variant(PER_CHANNEL_32_ROTATED, V4),
    "INT4, first token 16-bit": Variant(INT4, V4, sink_tokens=1),
    "INT4, first block 16-bit (sinks)": Variant(INT4, V4, sink_tokens=SINK_TOKENS),
    "INT4, own block 16-bit": Variant(INT4, V4, own_block_tokens=16),
    "INT4, sinks and own block 16-bit": Variant(INT4, V4, SINK_TOKENS, 16),
    "INT4 KIVI: per-channel key scales over 16-token blocks, own block 16-bit": Variant(PER_CHANNEL, V4, 0, 16),
    "INT4 KIVI as above, keys rotated": Variant(PER_CHANNEL_ROTATED, V4, 0, 16),
    "INT4 KIVI over 32-token blocks": Variant(PER_CHANNEL_32, V4, 0, 32),
    "INT4 KIVI over 32-token blocks, keys rotated": Variant(PER_CHANNEL_32_ROTATED, V4, 0, 32),
    "K8V4, values rotated": Variant(INT8, Codes(4, rotated=True)),
    "K8V4, values rotated in 32-channel groups": Variant(INT8, Codes(4, 32, rotated=True)),
    "K8V4, values in 32-channel groups": Variant(INT8, Codes(4, 32)),
    "K8V4, values clipped for least squared error": Variant(INT8, CLIPPED),
    "K8V4, first token 16-bit": Variant(INT8, V4, sink_tokens=1),
    "K8V4, sinks 16-bit": Variant(INT8, V4, sink_tokens=SINK_TOKENS),
    "K8V4, own block 16-bit": Variant(INT8, V4, own_block_tokens=16),
    "K8V4, sinks and own block 16-bit": Variant(INT8, V4, SINK_TOKENS, 16),
}


def own_block_attention(q, key, value, key_16_bit, value_16_bit, block_tokens: int, scale: float) -> torch.Tensor:
    """One sequence's causal attention where query i sees the stored K/V of earlier blocks and its own
    block's up to i in 16 bits. q [num_tokens, num_heads, head_dim], the rest [num_tokens, kv_heads, head_dim]."""
    block = torch.arange(q.shape[0]) // block_tokens
    own = (block[:, None] == block[None, :]).tril()
    mask = torch.cat([block[None, :] < block[:, None], own], dim=1)  # [num_tokens, 2 num_tokens]
    keys, values = torch.cat([key, key_16_bit]), torch.cat([value, value_16_bit])
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None].to(q.dtype),
                                          values.transpose(0, 1)[None].to(q.dtype), attn_mask=mask, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)


@contextlib.contextmanager
def emulating(variant: Variant):
    """A float16-cache engine's prefills attend K/V as `variant` stores them (one window per forward)."""
    attend = llama.prefill_attention

    def prefill(q, k, v, seq_lens, scale, prefixes=None):
        if prefixes or len(seq_lens) != 1:
            raise ValueError("emulated KV variants take one whole window per forward")
        key, value = variant.stored(k.float(), variant.key), variant.stored(v.float(), variant.value)
        if variant.own_block_tokens:
            return own_block_attention(q, key, value, k.half().float(), v.half().float(),
                                       variant.own_block_tokens, scale)
        return attend(q, key.to(q.dtype), value.to(q.dtype), seq_lens, scale)

    # the K/V arrive as computed (fp32), as a quantized layout's as_stored takes them
    with mock.patch.object(DenseLayout, "as_stored", lambda self, rows, is_key: rows), \
            mock.patch.object(llama, "prefill_attention", prefill):
        yield


def measure(names: list[str], window_tokens: int, max_windows: int | None = None) -> dict[str, Comparison]:
    """Each variant of `names` against the float16 cache, over the held text's windows."""
    rows = {}
    with teacher_forced_engine(MODEL, window_tokens, kv_cache_dtype=KV_REFERENCE) as llm:
        windows = held_windows(llm.tokenizer, llm.engine.model_config.vocab_size, window_tokens, max_windows)
        reference = teacher_forced(llm, windows)
        for name in names:
            with emulating(VARIANTS[name]):
                rows[name] = comparison(MODEL, name, f"kv_cache_dtype={KV_REFERENCE}", teacher_forced(llm, windows),
                                        reference)
            print(f"{window_tokens} tokens: {name}: {rows[name].top1_agreement:.2%}, "
                  f"{rows[name].perplexity_change:+.2%}", flush=True)
    return rows


def table(results: dict[int, dict[str, Comparison]]) -> str:
    """A row per variant: its bytes and capacity, then top-1 agreement and perplexity change per window size."""
    sizes = sorted(results)
    lines = ["| variant | bytes | capacity | " + " | ".join(f"top-1, {n} | ppl, {n}" for n in sizes) + " |",
             "|---|---|---|" + "---|---|" * len(sizes)]
    for name in [n for n in VARIANTS if any(n in rows for rows in results.values())]:
        size_bytes = VARIANTS[name].bytes_per_token
        cells = [f"{results[n][name].top1_agreement * 100:.2f}% | {results[n][name].perplexity_change * 100:+.2f}%"
                 if name in results[n] else " | " for n in sizes]
        lines.append(f"| {name} | {size_bytes:.0f} | {4 * HEAD_DIM / size_bytes:.2f}x | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window-tokens", type=int, nargs="+", default=list(WINDOW_TOKENS),
                        help="multiples of 32 (the longest per-channel block)")
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), help="default: all")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = {n: measure(args.variant or list(VARIANTS), n) for n in args.window_tokens}
    rows = [asdict(c) | {"window_tokens": n, "bytes_per_token": VARIANTS[name].bytes_per_token,
                         "perplexity_change": c.perplexity_change}
            for n, by_name in results.items() for name, c in by_name.items()]
    positions = ", ".join(f"{next(iter(r.values())).num_positions} at {n}" for n, r in results.items())
    title = (f"Held text: {HELD_TEXT.name}, {MODEL}, fp32, teacher-forced, each variant emulated on a "
             f"{KV_REFERENCE} cache and against it; positions: {positions} (`benchmarks/kernels/kv_variants.py`)")
    write_results(args.output, rows, f"{title}\n\n{table(results)}\n")
    print(table(results))


if __name__ == "__main__":
    main()
