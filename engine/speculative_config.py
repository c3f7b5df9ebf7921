"""--speculative-config: vLLM's flag and keys, parsed once as the engine's config is built.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
    {"method": "draft_model", "model": PATH_OR_NAME, "num_speculative_tokens": k,
     "quantization": "int4" | "none", "load_format": "auto" | "dummy" | ...}

and tandem's own key for either, "adaptive": true (the default: each step verifies the drafts its
measured costs say pay, engine/speculative/budget.py) or false (every decode verifies k drafts
wherever the proposer has them, as vLLM does).

vLLM's other methods (EAGLE, MTP, ...) are refused by name. No torch here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
# n-gram lookup bounds where none are given: a 1-token match drafts noise, and past 4 tokens a
# longer match rarely predicts better than the longest of 4 (vLLM's example uses 4)
DEFAULT_LOOKUP_MIN = 2
DEFAULT_LOOKUP_MAX = 4
MAX_SPECULATIVE_TOKENS = 16  # a verify's rows grow with it, while acceptance falls geometrically
_KEYS = {"ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive"},
         "draft_model": {"method", "num_speculative_tokens", "model", "quantization", "load_format", "adaptive"}}
DRAFT_QUANTIZATIONS = ("int4", "none")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # the most drafts one verify carries (adaptive below it)
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN  # ngram: the shortest suffix matched
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX  # ngram: the longest suffix matched
    model: str | None = None  # draft_model: a GGUF file, an HF directory, the embedded model's name
    quantization: str = "int4"  # draft_model: its decoder layers' format (int4: small, resident)
    load_format: str = "auto"  # draft_model: as --load-format (dummy: a preset's random weights)
    adaptive: bool = True  # drafts only where measured costs say they pay (False: always k)

    @classmethod
    def parse(cls, value: "SpeculativeConfig | str | dict[str, Any]") -> "SpeculativeConfig":
        """The flag's JSON text, a mapping (YAML, Python), or a config; ValueError naming the key."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"must be a JSON object such as "
                                 f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {value!r} ({exc})') from None
        if not isinstance(value, dict):
            raise ValueError(f"must be a JSON object with a method ({' or '.join(METHODS)}), got {value!r}")
        return cls._from_mapping(value)

    @classmethod
    def _from_mapping(cls, mapping: dict[str, Any]) -> "SpeculativeConfig":
        method = mapping.get("method")
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)} (vLLM's eagle and mtp are not built "
                             f"here), got {method!r}")
        unknown = sorted(set(mapping) - _KEYS[method])
        if unknown:
            raise ValueError(f"method {method} takes {', '.join(sorted(_KEYS[method]))}; unknown: {', '.join(unknown)}")
        config = cls(method=method, num_speculative_tokens=_int(mapping, "num_speculative_tokens", None, 1),
                     prompt_lookup_min=_int(mapping, "prompt_lookup_min", DEFAULT_LOOKUP_MIN, 1),
                     prompt_lookup_max=_int(mapping, "prompt_lookup_max",
                                            max(DEFAULT_LOOKUP_MAX, mapping.get("prompt_lookup_min") or 0), 1),
                     model=mapping.get("model"), quantization=mapping.get("quantization", "int4"),
                     load_format=mapping.get("load_format", "auto"), adaptive=mapping.get("adaptive", True))
        config.check()
        return config

    def check(self) -> None:
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("method draft_model needs a model: a GGUF file, an HF directory or the embedded "
                             "model's name")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(DRAFT_QUANTIZATIONS)}, got {self.quantization!r}")

    def to_dict(self) -> dict[str, Any]:
        keys = sorted(_KEYS[self.method])
        return {key: getattr(self, key) for key in keys}


def _int(mapping: dict[str, Any], key: str, default: int | None, minimum: int) -> int:
    value = mapping.get(key, default)
    if value is None:
        raise ValueError(f"{key} is required (an integer >= {minimum})")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value
