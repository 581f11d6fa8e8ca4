"""SamplingParams: what a request asks of the sampler and of the stop checks. No torch."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tinyserve.utils.grammar_size import check_schema, check_spec_text
from tinyserve.utils.regex_size import check_regex, schema_patterns

_MAX_STOP_STRINGS = 64
_MAX_STOP_STRING_LEN = 512
_MAX_N = 16
# Temperatures (vLLM's _SAMPLING_EPS and _MAX_TEMP): below 1e-5 greedy, below 1e-2 raised to
# 1e-2 (a sharper one is greedy in all but float overflow); above 1e6 refused.
_GREEDY_BELOW, _MIN_TEMPERATURE, _MAX_TEMPERATURE = 1e-5, 1e-2, 1e6
_MAX_LOGPROBS = 20
_TOKEN_ID = re.compile(r"-?[0-9]{1,18}")  # ASCII digits only (int() takes ' 1', '١')


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, any JSON object, a regex, one of several
    strings, or a grammar (vLLM's ``structured_outputs``). Exactly one mode."""

    json: str | dict | None = None  # a JSON schema (dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark / EBNF, as the grammar library reads it
    json_object: bool | None = None
    field: str = "structured_outputs"  # the request field it came from, for error messages
    # The grammar starts after the thinking block closes with this token (structured/
    # thinking.py); think_start_id may open one at the first token; thinking_open: the
    # prompt already did. None: the grammar applies from the first token.
    think_end_id: int | None = None
    think_start_id: int | None = None
    thinking_open: bool = False
    # A check of the finished answer for what the grammar cannot enforce, where the answer
    # is not one JSON value (tool calls in a template's format: entrypoints/tool_formats.py):
    # the answer's text -> None, or why it fails (the request's 400). JSON schemas are checked
    # by the output processor itself.
    answer_check: Callable[[str], str | None] | None = dataclasses.field(
        default=None, compare=False
    )

    def __post_init__(self) -> None:
        modes = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            modes.append("json_object")
        if len(modes) != 1:
            raise ValueError(
                f"{self.field}: give exactly one of json, regex, choice, grammar, "
                f"json_object (got {', '.join(modes) or 'none'})"
            )
        schema = self.json
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"{self.field}: json is not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"{self.field}: json must be a JSON schema object")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"{self.field}: choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{self.field}: {name} must be a non-empty string")
        # Specs and regexes are sized here, when the request arrives (a 400), not mid-answer
        # or in the grammar library; the only way to a grammar spec
        # (engine/structured_output.py) starts from these params.
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None:
                check_spec_text(getattr(self, name), self.field, name)
        if self.choice is not None:
            check_spec_text("".join(self.choice), self.field, "list of choices")
        if schema is not None:
            check_schema(schema, len(json.dumps(schema, separators=(",", ":"))), self.field)
        if self.regex is not None:
            check_regex(self.regex, self.field)
        for pattern in schema_patterns(schema):
            check_regex(pattern, self.field)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping. Validated on construction (ValueError names the field).

    ``temperature == 0`` means greedy. ``top_k == -1`` (or 0) disables top-k. ``seed`` makes
    the request's random draws depend only on the seed, not on what else shares the batch.
    ``logprobs=k`` returns the sampled token's logprob plus the top-k alternatives (k may be 0).
    ``prompt_logprobs=k``: the same for every prompt token after the first, from the prefill's
    own logits (such a request takes no prefix-cache hits: cached positions have no logits).
    ``max_tokens=0`` scores the prompt only: the request ends after its prefill, no token.
    ``prediction``: token ids the output is expected to be close to (OpenAI's Predicted
    Outputs): the request's speculative drafts come from them (spec_decode/prediction.py);
    the output is what it would be without.
    ``cache_salt`` (vLLM's field): requests with different salts share no cached state — no
    prefix-cache blocks and no suffix-decoding drafts from each other's outputs (both make a
    request faster when another's text matches: a timing side channel); unsalted requests
    share one namespace.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    prediction: tuple[int, ...] | None = None
    cache_salt: str | None = None
    # The sampler's (ids, values) tensors of logit_bias, made at the request's first step:
    # read from the dict per row and step, a bias over the whole vocabulary (n = 16) took
    # ~0.4 s of every step in Python, slowing every other request ~5x.
    logit_bias_tensors: Any = field(default=None, init=False, repr=False, compare=False)
    # The compiled grammar, once the async front has awaited it (AsyncEngine.prepare): the
    # engine thread takes it here, never recompiling one the compile cache evicted meanwhile.
    compiled_grammar: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 1024):
            raise ValueError(
                f"cache_salt must be a non-empty string of <= 1024 characters, got {salt!r:.40}"
            )
        _check_containers(self)
        _check_int("n", self.n, 1, _MAX_N)
        self.temperature = _checked_temperature(self.temperature)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1, None)
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.logit_bias:
            self.logit_bias = _checked_bias(self.logit_bias)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 0, None)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if len(self.stop) > _MAX_STOP_STRINGS:
            raise ValueError(
                f"stop: at most {_MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError("stop strings must be non-empty strings")
            if len(s) > _MAX_STOP_STRING_LEN:
                raise ValueError(f"stop strings must be at most {_MAX_STOP_STRING_LEN} characters")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, None)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, _MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, _MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: token ids in range."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids: {t} is not below the vocab size {vocab_size}")
        for t in self.logit_bias or {}:
            if not 0 <= t < vocab_size:
                raise ValueError(f"logit_bias: token id {t} is outside [0, {vocab_size})")
        if any(not 0 <= t < vocab_size for t in self.prediction or ()):
            raise ValueError(f"prediction: a token id is outside [0, {vocab_size})")


def _check_containers(p: SamplingParams) -> None:
    """The offline API's wrong types named (they raised TypeError / AttributeError deep in
    the engine): lists where lists go, a dict of logit_bias, a StructuredOutputsParams (or
    the dict of its fields), token ids as the prediction."""
    if isinstance(p.stop, str):
        p.stop = [p.stop]
    for name in ("stop", "stop_token_ids"):
        value = getattr(p, name)
        if value is not None and not isinstance(value, (list, tuple, set, frozenset)):
            raise ValueError(f"{name} must be a list, got {value!r:.60}")
        setattr(p, name, list(value or []))
    if p.logit_bias is not None and not isinstance(p.logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {p.logit_bias!r:.60}")
    so = p.structured_outputs
    if isinstance(so, dict):
        try:
            p.structured_outputs = StructuredOutputsParams(**so)
        except TypeError as e:
            raise ValueError(f"structured_outputs: {e}") from None
    elif so is not None and not isinstance(so, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {so!r:.60}")
    if p.prediction is not None:
        ids = p.prediction
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
            raise ValueError(f"prediction must be token ids (a list of ints), got {ids!r:.60}")
        for t in ids:
            _check_int("prediction", t, 0, None)
        p.prediction = tuple(ids)


def _checked_temperature(t: object) -> float:
    _check_float("temperature", t)
    if not 0 <= t <= _MAX_TEMPERATURE:  # 1e39 was inf in float32: -inf (a masked logit) /
        raise ValueError(  # inf = NaN, sampled as token 0 through any mask
            f"temperature must be in [0, {_MAX_TEMPERATURE:g}], got {t}"
        )
    if t < _GREEDY_BELOW:  # as vLLM: greedy (1e-46 was 0 in float32 but sampled at T = 1
        return 0.0  # by the host's reading)
    # As vLLM: raised (logits / 1e-40 overflowed into ties of every positive logit).
    return max(float(t), _MIN_TEMPERATURE)


def _checked_bias(logit_bias: dict) -> dict[int, float]:
    bias: dict[int, float] = {}
    for k, v in logit_bias.items():
        plain = isinstance(k, int) and not isinstance(k, bool)  # the offline API's ints
        if not plain and not (isinstance(k, str) and _TOKEN_ID.fullmatch(k)):  # int() also
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}")  # read "1_0"
        tok = int(k)
        _check_float("logit_bias", v)
        if not -100.0 <= float(v) <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {v}")
        bias[tok] = float(v)
    return bias


def _check_int(name: str, value: object, lo: int | None, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be finite, got {value!r}")
