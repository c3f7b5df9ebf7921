"""Random weights in a preset's shape, for benchmarking models whose weights we do not have.

Drawing ~850M normals for one Llama-70B layer takes seconds on a CPU, and benchmarks only
need values that are well scaled and not degenerate. So each loader draws one pool of
normals from the seed, and every tensor is a window of that pool (wrapping around) starting
at an offset drawn from (seed, layer): reloading a layer gives identical tensors, and
building one costs a memory copy.
"""
from __future__ import annotations

import random

import torch

from engine.model_config import ModelConfig
from engine.weights.base import WeightLoader, global_shapes, layer_shapes, register_loader

# A prime: row r of a [rows, width] tensor starts at pool[(offset + r * width) % POOL_SIZE],
# so no two rows of any tensor with fewer than POOL_SIZE rows are equal.
POOL_SIZE = 4_194_301
WEIGHT_STD = 0.02  # as Hugging Face's initializer_range: keeps activations O(1) through norms
_GLOBALS_STREAM = "globals"


@register_loader("dummy")
class DummyLoader(WeightLoader):
    def __init__(self, model: str, seed: int = 0) -> None:
        self.config = ModelConfig.from_preset(model)
        self.source = f"dummy:{model}"
        self.tokenizer_source = None
        self.seed = seed
        self._pools: dict[torch.dtype, torch.Tensor] = {}  # dtype -> the pool, stored twice over

    def load_globals(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return self._generate(global_shapes(self.config), _GLOBALS_STREAM, dtype)

    def load_layer(self, index: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        self._check_layer_index(index)
        return self._generate(layer_shapes(self.config, index), f"layer{index}", dtype)

    def _generate(self, shapes: dict[str, tuple[int, ...]], stream: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        # A string seed is hashed deterministically (unlike hash() of a tuple across runs).
        rng = random.Random(f"{self.seed}:{stream}")
        weights = {}
        for key, shape in shapes.items():
            offset = rng.randrange(POOL_SIZE)  # drawn for every key so later keys do not shift
            is_norm = key.endswith("norm")
            weights[key] = torch.ones(shape, dtype=dtype) if is_norm else self._window(shape, offset, dtype)
        return weights

    def _window(self, shape: tuple[int, ...], offset: int, dtype: torch.dtype) -> torch.Tensor:
        """Element i of the flattened tensor is pool[(offset + i) % POOL_SIZE]."""
        doubled_pool = self._pool(dtype)
        out = torch.empty(shape, dtype=dtype)
        flat = out.view(-1)
        for start in range(0, flat.numel(), POOL_SIZE):
            count = min(POOL_SIZE, flat.numel() - start)
            flat[start : start + count] = doubled_pool[offset : offset + count]
        return out

    def _pool(self, dtype: torch.dtype) -> torch.Tensor:
        pool = self._pools.get(dtype)
        if pool is None:
            # Drawn in float32 so each dtype holds the same values up to rounding.
            generator = torch.Generator().manual_seed(self.seed)
            values = torch.randn(POOL_SIZE, generator=generator) * WEIGHT_STD
            # Stored twice over so a window starting anywhere is one contiguous slice.
            pool = self._pools[dtype] = torch.cat([values, values]).to(dtype)
        return pool
