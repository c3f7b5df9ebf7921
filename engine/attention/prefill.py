"""Causal prefill attention over packed sequences (varlen, no padding) through torch's SDPA."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                      scale: float) -> torch.Tensor:
    """Causal attention over packed sequences, each through SDPA on its own tokens (no padding).

    q [num_tokens, num_heads, head_dim], k/v [num_tokens, kv_heads, head_dim] -> [num_tokens, num_heads, head_dim]
    """
    out = torch.empty_like(q)
    start = 0
    for length in seq_lens:
        end = start + length
        # SDPA wants [batch, heads, tokens, head_dim]
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            k[start:end].transpose(0, 1).unsqueeze(0),
            v[start:end].transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=True,
        ).squeeze(0).transpose(0, 1)
        start = end
    return out
