"""KV cache formats as the planners see them: bytes per element, scales included (no torch).

The 16-bit and fp32 formats store each key and value element as it is; `int8` and `int4` store
group-quantized codes with an fp16 scale (and, INT4, an fp16 minimum) per group of
`KV_GROUP_SIZE` channels of a head, per token (kernels/kv_quant.py is the layout); `k8v4` stores
keys as int8 does and values as int4 does.
"""
from __future__ import annotations

from dataclasses import dataclass

KV_GROUP_SIZE = 64  # channels per scale; kernels/kv_quant.GROUP_SIZE (tests check they agree)
_SCALE_BYTES = 2  # fp16
QUANTIZED_KV_BLOCK_MULTIPLE = 16  # the kernels read a quantized unit's tokens in whole vectors


@dataclass(frozen=True)
class KVFormat:
    name: str
    key_bits: int  # bits of one stored key element (its code, for the quantized formats)
    value_bits: int  # the same for values
    quantized: bool = False

    @property
    def element_bytes(self) -> float:
        """Bytes one K or V element takes on average (a token's K and V bytes are 2 * head_dim of
        them), its share of its group's scale (and minimum) included."""
        return (self._side_bytes(self.key_bits) + self._side_bytes(self.value_bits)) / 2

    def _side_bytes(self, bits: int) -> float:
        """Bytes of one element stored in `bits`-bit codes (or as it is)."""
        if not self.quantized:
            return bits / 8
        scales = 2 if bits == 4 else 1  # INT4 keeps a minimum beside the scale
        return bits / 8 + scales * _SCALE_BYTES / KV_GROUP_SIZE

    def describe(self) -> str:
        """One line for the start log and `tandem plan`."""
        if not self.quantized:
            return f"KV {self.name}"
        sides = ([self._describe_side(self.key_bits)] if self.key_bits == self.value_bits else
                 [f"keys {self._describe_side(self.key_bits)}", f"values {self._describe_side(self.value_bits)}"])
        return f"KV {self.name}: {'; '.join(sides)} ({self.element_bytes:.4g} bytes an element)"

    @staticmethod
    def _describe_side(bits: int) -> str:
        extra = "scale and minimum" if bits == 4 else "scale"
        return f"{bits}-bit codes, an fp16 {extra} per {KV_GROUP_SIZE} channels of a token"

    def check_head_dim(self, head_dim: int) -> str | None:
        """Why this format cannot hold heads of `head_dim` channels, or None."""
        if self.quantized and head_dim % KV_GROUP_SIZE:
            return (f"--kv-cache-dtype {self.name} needs head_dim a multiple of {KV_GROUP_SIZE} (its scale "
                    f"groups), and this model's is {head_dim}; use a 16-bit KV cache")
        return None


KV_FORMATS = {f.name: f for f in (KVFormat("float32", 32, 32), KVFormat("bfloat16", 16, 16),
                                  KVFormat("float16", 16, 16), KVFormat("int8", 8, 8, True),
                                  KVFormat("int4", 4, 4, True), KVFormat("k8v4", 8, 4, True))}
KV_CACHE_DTYPES = ("auto", *KV_FORMATS)  # auto: the compute dtype's


def kv_format(name: str) -> KVFormat:
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose from {', '.join(KV_CACHE_DTYPES)}") from None
