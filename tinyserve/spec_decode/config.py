"""``--speculative-config``: vLLM's vocabulary for n-gram prompt lookup and suffix decoding.
Torch-free.

``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}`` or ``{"method": "suffix"}`` (spec_decode/suffix.py; vLLM's
``suffix_decoding_*`` keys, plus ``suffix_decoding_max_cached_tokens``, ours: the memory
bound), as JSON text (the CLI) or a dict (``LLM(speculative_config=...)``); ``"auto"`` (the
default: suffix decoding, priced per request by the measured step costs; served on Zen 3 it
lost on no cell beyond noise, 1.3-1.5x at one stream: benchmarks/README.md) or ``"off"`` / None (no drafts but a
request's own prediction and its grammar's forced tokens).
The adaptive policy's knobs (ours, not vLLM's; spec_decode/proposer.py) are
``max_batch_size``, ``min_acceptance_rate`` and ``adaptive``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

_FIELD = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    # None: 4 for ngram, 16 (the most) for suffix — the cost model picks the length.
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Adaptive policy (spec_decode/proposer.py): no drafts in a step with more running
    # requests than this, none for a request whose acceptance estimate is below this (a
    # floor; the measured step costs decide above it), and with adaptive off every
    # proposal is drafted in full.
    max_batch_size: int = 8
    min_acceptance_rate: float = 0.0
    adaptive: bool = True
    # Suffix decoding (spec_decode/suffix.py), vLLM's names and defaults; the global cache
    # holds at most this many earlier outputs and tokens (8 bytes each) over all salts.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_cached_tokens: int = 1 << 16  # 0.2 ms a lookup at the cap here
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # "auto" (the default) rather than asked for: the engine leaves it off where the model's
    # numeric path is not the same for a verified draft as for a decoded token (EngineCore).
    by_default: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "suffix"):
            raise ValueError(f"{_FIELD}: method must be 'ngram' or 'suffix', got {self.method!r}")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", 16 if self.suffix else 4)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                     "suffix_decoding_max_cached_tokens"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_FIELD}: {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"{_FIELD}: prompt_lookup_min ({self.prompt_lookup_min}) is larger than "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.num_speculative_tokens > 16:
            raise ValueError(f"{_FIELD}: num_speculative_tokens must be <= 16")
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"{_FIELD}: max_batch_size must be an integer >= 1")
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"{_FIELD}: min_acceptance_rate must be a number in [0, 1]")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"{_FIELD}: adaptive must be true or false, got {self.adaptive!r}")
        factor = self.suffix_decoding_max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
            raise ValueError(f"{_FIELD}: suffix_decoding_max_spec_factor must be a number > 0")
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, int | float) or not 0 <= prob <= 1:
            raise ValueError(f"{_FIELD}: suffix_decoding_min_token_prob must be in [0, 1]")

    @property
    def suffix(self) -> bool:
        return self.method == "suffix"

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """JSON text, a dict, a config, "auto" (suffix decoding) or "off" / None (speculation
        off). Raises ValueError naming the field for anything else."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if value in ("off", "none"):
            return None
        if value == "auto":
            return cls(method="suffix", by_default=True)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{_FIELD}: not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{_FIELD}: must be a JSON object")
        known = {f.name for f in fields(cls)} - {"by_default"}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"{_FIELD}: unknown key(s) {', '.join(map(repr, unknown))}")
        return cls(**value)
