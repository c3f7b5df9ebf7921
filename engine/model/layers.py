"""The Llama block's small layers: RMSNorm and rotary position embeddings (matmuls live in
engine/quant, behind weight objects)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.model_config import RopeScaling
from kernels import cpu as cpu_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In fp32 as HF does, then back to the compute dtype before the weight multiply.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


FUSED_NORM_MULTIPLE = 16  # the C++ kernel's vector width, which hidden must be a multiple of
FUSED_ROPE_MULTIPLE = 32  # head_dim: each half a multiple of the vector width


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm in one C++ call (kernels.cpu.rms_norm) where it applies: 2-D CPU rows whose width
    is a multiple of 16; else the torch ops above."""
    if x.is_cpu and x.dim() == 2 and x.shape[1] % FUSED_NORM_MULTIPLE == 0 and cpu_kernels.is_available():
        return cpu_kernels.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's glue: gate_up [tokens, 2 * intermediate] -> silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul in one C++ call (kernels.cpu.silu_mul) where it applies: 2-D CPU rows whose
    halves are multiples of 16 (not empty: a sliced MLP may leave the GPU no units); else
    the torch ops above."""
    if (gate_up.is_cpu and gate_up.dim() == 2 and gate_up.shape[1] > 0
            and gate_up.shape[1] % (2 * FUSED_NORM_MULTIPLE) == 0 and cpu_kernels.is_available()):
        return cpu_kernels.silu_mul(gate_up)
    return silu_mul(gate_up)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin per position, fp32, rotate-half layout: [max_positions, head_dim]."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, max_positions: int,
                 device: torch.device, fused: bool = False) -> None:
        self.fused = fused and cpu_kernels.is_available()  # one C++ call (kernels.cpu.rope) where it applies
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [num_tokens, heads, head_dim] by each token's position (rotate-half, HF's
        convention: pairs are (i, i + head_dim/2)); math in fp32."""
        if self.fused and x.is_cpu and x.shape[-1] % FUSED_ROPE_MULTIPLE == 0:
            return cpu_kernels.rope(x, positions, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        xf = x.float()
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)
