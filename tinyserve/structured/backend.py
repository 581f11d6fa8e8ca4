"""The grammar library behind one seam: llguidance (chosen by benchmarks/bench_grammar_libs.py;
see benchmarks/README.md, "Grammar libraries").

Who owns what: a ``GrammarBackend`` is built once per model (tokenizer, logits width) and is
shared; ``compile`` is thread-safe and runs on the compile pool (manager.py), never on the
engine thread. A ``CompiledGrammar`` is immutable and shared by every request with the same
spec. A ``Matcher`` belongs to one request and is used by the engine thread only.

Bitmasks are ``torch.int32 [rows, ceil(vocab_size / 32)]`` (applied to the logits by the
sampler, worker/sampler.py ``apply_grammar_bitmask``): bit ``t % 32`` of word ``t // 32``
is 1 when token ``t`` may be sampled next. Bits of ids the tokenizer does not have (the
logits may be wider than the vocabulary) are always 0. EOS is allowed only where the grammar
may end; once the grammar has ended, only EOS is.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from tinyserve.structured.schema_fixes import fix_schema
from tinyserve.structured.spec import StructuredOutputSpec

# Bounds on the library's work so a pathological grammar fails (a 400 at compile time, or the
# request ended at a step) instead of stalling: llguidance's defaults, lexer states raised
# for large enums, grammar size capped.
PARSER_LIMITS = dict(
    max_grammar_size=2_000_000, max_lexer_states=250_000, step_lexer_fuel=1_000_000
)
# oneOf is compiled as anyOf (exact when the branches are disjoint, the usual case: a type and
# null, or objects told apart by a const; llguidance refuses it otherwise); an answer to a
# schema with a oneOf is validated after generation (schema_approx.uses_keywords).
# The JSON layout: one line, ", " and ": " between items (json.dumps's form), no other
# whitespace, as issue 39 asked. Bounded pretty-printing (schema_approx.PRETTY_WHITESPACE,
# `serve --json-pretty`) was measured against it on 100 real-world schemas
# (benchmarks/README.md): 8 fewer answers cut greedy, 10 more cut sampled at temperature 1,
# within noise both ways, while one line spends ~22% fewer tokens on a valid answer. A
# schema's own top-level "x-guidance" key overrides these key by key.
_JSON_OPTIONS = {"coerce_one_of": True, "whitespace_flexible": False, "whitespace_pattern": None,
                 "item_separator": ", ", "key_separator": ": "}  # fmt: skip
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def _parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS)


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled spec: ``_template`` is a matcher at the start state that is never advanced;
    each request's ``Matcher`` is a deep copy of it."""

    spec: StructuredOutputSpec
    compile_seconds: float
    _template: llguidance.LLMatcher
    # The size of the grammar text the library compiled: what the compile cache counts
    # (manager.py; compiled grammars measured 60-72 bytes of memory per byte of it).
    grammar_bytes: int = 0


class Matcher:
    """One request's position in its grammar (engine thread only)."""

    def __init__(self, backend: GrammarBackend, template: llguidance.LLMatcher):
        self._backend = backend
        self._template = template  # the compiled grammar's start state, shared, never advanced
        self._m = template.deep_copy()
        self._eos_after_stop = 0  # EOS accepted once stopped: llguidance does not record them
        self._consumed: list[int] = []  # what the library took: rollback's way back (rebuild)
        self._fork = False  # a fork holds no tokens from before it: it never rolls back

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over all of ``token_ids``, or over none: False (state unchanged) when any
        is not allowed where it stands."""
        ids = list(token_ids)
        if not ids:
            return True
        if any(t < 0 or t >= self._backend.tokenizer_vocab_size for t in ids):
            return False
        if self._m.is_error():  # a dead end or a parser limit: nothing, EOS included
            return False
        if self._m.is_stopped():
            # Only EOS may follow. llguidance counts none in validate_tokens, errors on
            # consume_tokens and takes consume_token without recording it in its history.
            # Those EOS are not in its history, so we count them for rollback().
            if not all(t in self._backend.eos_token_ids for t in ids):
                return False
            self._eos_after_stop += len(ids)
            return True
        if self._m.validate_tokens(ids) != len(ids):
            return False
        if not self._m.consume_tokens(ids):
            return False
        self._consumed += ids
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this matcher's allowed set into ``bitmask[row]``. A matcher the library put
        in an error state (a step over its fuel limit, a dead end) allows only EOS, which
        ``accept_tokens`` then refuses too: the request ends in an error naming it."""
        # What llguidance.torch.fill_next_token_bitmask does; that module is not imported: it
        # wraps a helper in torch.compile at import, which loads torch._dynamo (~3.4 s of a
        # 13 s server start on 2 Zen 3 cores, measured with py-spy).
        mask = bitmask[row]
        ok = bitmask.dim() == 2 and bitmask.dtype == torch.int32 and bitmask.is_cpu
        if not ok or not mask.is_contiguous():
            raise ValueError("bitmask: a contiguous int32 CPU tensor, one row per request")
        self._m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
        if self._m.is_error():
            self._backend.fill_eos_only(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens: the matcher is rebuilt from the start
        and the tokens kept (0.2-0.5 us a kept token). Not llguidance's own rollback: the
        masks it computes afterwards can be those of states it left — its cache of the last
        mask, keyed by the lexer state and the Earley row index (1.9), is kept, so a state
        reached afterwards by other tokens with the same key (inside edit_file's path string
        where the rolled-back tokens were inside read_file's) got the rolled-back state's
        mask, and a token it allowed was refused (the agent loop's 500, "the grammar rejected
        token 23597"); and computing the rolled-back state's mask right after, to replace
        that entry, still left a differential fuzz finding wrong masks within seconds (tried
        2026-12-07; docs/architecture.md), where rebuilding found none. Its reset keeps the
        cache too. The engine never rolls back: it walks drafts on a ``fork``."""
        if self._fork:  # a rebuild would replay its own tokens only, from the start
            raise ValueError("a fork walks drafts forward only: it does not roll back")
        ours = min(num_tokens, self._eos_after_stop)
        self._eos_after_stop -= ours
        num_tokens -= ours
        if not num_tokens:
            return
        if num_tokens > len(self._consumed):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._consumed)} taken")
        del self._consumed[len(self._consumed) - num_tokens :]
        # Also the way out of a state nothing extends (a draft into a schema part no value
        # satisfies), where the library's matcher is in an error state.
        self._m = self._template.deep_copy()
        if self._consumed and not self._m.consume_tokens(self._consumed):
            raise ValueError(f"cannot replay {len(self._consumed)} tokens: {self._m.get_error()}")

    def fork(self) -> Matcher:
        """An independent matcher at this state, to walk a step's drafts on and throw away:
        the request's own matcher only ever moves forward (``rollback``). llguidance's deep
        copy of the parser state grows with the answer: a step of 4 drafts took 51 / 73 /
        144 / 298 us at 100 / 1,000 / 3,000 / 6,000 tokens of a JSON answer (the rolled-back
        walk it replaces: 29-44 us). The tokens before it are not copied (they grow with the
        answer too), so a fork does not roll back."""
        other = Matcher.__new__(Matcher)
        other._backend, other._template = self._backend, self._template
        other._m = self._m.deep_copy()
        other._eos_after_stop = self._eos_after_stop
        other._consumed, other._fork = [], True
        return other

    def forced_tokens(self) -> list[int]:
        """The tokens that follow whatever the model does: the grammar allows one
        continuation only from here (a property name, punctuation, the rest of an enum
        value; llguidance's fast-forward, SGLang's jump-forward). [] when none, or once
        the grammar has ended or failed."""
        if self._m.is_stopped() or self._m.is_error():
            return []
        return list(self._m.compute_ff_tokens())

    def error(self) -> str:
        """The library's message once it put the matcher in an error state (a parser limit
        passed, or a state nothing extends), else "". A matcher rebuilt by rollback has not
        computed its mask yet, so a dead end shows only once it does: computed here (this is
        asked when a token was refused, never per step)."""
        if not self._m.is_error() and not self._m.is_stopped():
            self._m.compute_bitmask()
        return self._m.get_error() if self._m.is_error() else ""

    def is_terminated(self) -> bool:
        """True once nothing but EOS can follow (EOS accepted, or the grammar cannot extend)."""
        return self._m.is_stopped()

    def reset(self) -> None:
        """Back to the start state (a preempted request recomputed from scratch). A copy of
        the template: llguidance's reset keeps its mask cache (``rollback``)."""
        self._m = self._template.deep_copy()
        self._eos_after_stop = 0
        self._consumed = []


class GrammarBackend:
    """Compiles specs for one tokenizer and applies bitmasks to logits ``vocab_size`` wide
    (the model's logits width, which may exceed ``len(tokenizer)``)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] | None = None):
        self.tokenizer_vocab_size = len(tokenizer)
        if vocab_size < self.tokenizer_vocab_size:
            raise ValueError(
                f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)}"
            )
        self.vocab_size = vocab_size
        eos = list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]
        if any(e is None for e in eos):
            raise ValueError("the tokenizer has no EOS token: pass eos_token_ids")
        self.eos_token_ids = eos
        # n_vocab = the logits width: llguidance never allows ids past the tokenizer's own.
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    # ------------------------------------------------------------------ compile
    def compile(self, spec: StructuredOutputSpec, check=None) -> CompiledGrammar:
        """Thread-safe (the library drops the GIL while it builds). Raises ValueError whose
        message starts with ``spec.field`` and names what is unsupported or invalid.

        ``check(grammar_text) -> (is_error, messages)`` validates first; the compile pool
        passes ``GrammarSandbox.check`` (sandbox.py: a child process, so a grammar the
        library crashes on fails this request only). Without it, validated here."""
        t0 = time.perf_counter()
        limits = _parser_limits()
        if check is None:
            check = lambda text: llguidance.LLMatcher.validate_grammar_with_warnings(  # noqa: E731
                text, self._tokenizer, limits=limits
            )
        try:
            grammar = self._grammar_text(spec)
        except ValueError as e:  # a keyword's value the rewrites refuse (schema_fixes.py)
            raise ValueError(_error_message(spec, str(e))) from None
        is_error, messages = check(grammar)
        if is_error and spec.kind == "json" and "too large" in " ".join(messages):
            # The narrowed keywords multiplied out: drop them all, each checked after
            # (structured/schema_approx.py).
            grammar = self._grammar_text(spec, narrow=False)
            is_error, messages = check(grammar)
        if is_error:
            raise ValueError(_error_message(spec, messages[0] if messages else "invalid"))
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=limits)
        if template.is_error():
            raise ValueError(_error_message(spec, template.get_error()))
        return CompiledGrammar(spec, time.perf_counter() - t0, template, len(grammar))

    def _grammar_text(self, spec: StructuredOutputSpec, narrow: bool = True) -> str:
        grammar_of = llguidance.LLMatcher
        if spec.kind == "json":
            schema = json.dumps(fix_schema(json.loads(spec.value), narrow), ensure_ascii=False)
            return grammar_of.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if spec.kind == "json_object":
            return grammar_of.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if spec.kind == "regex":
            return grammar_of.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            # JSON string literals are Lark string literals. The choices are one terminal (the
            # lexer's regex), not alternatives of a rule: a rule of over 2,000 alternatives
            # outgrows the parser's row limit at the first token.
            choices = " | ".join(json.dumps(c) for c in json.loads(spec.value))
            return grammar_of.grammar_from_lark(f"start: CHOICE\nCHOICE: {choices}")
        text = spec.value
        if "::=" in text:  # GBNF (llama.cpp's EBNF)
            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # the converter raises for what it cannot read
                raise ValueError(f"{spec.field}: invalid GBNF grammar: {e}") from None
        return grammar_of.grammar_from_lark(text)

    # ------------------------------------------------------------------ matchers and masks
    def matcher(self, compiled: CompiledGrammar) -> Matcher:
        return Matcher(self, compiled._template)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self.bitmask_width), -1, dtype=torch.int32)  # [rows, W]

    def fill_eos_only(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        for t in self.eos_token_ids:
            word = bitmask[row, t // 32].item() | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word


def _error_message(spec: StructuredOutputSpec, message: str) -> str:
    message = message.strip()
    found = _UNIMPLEMENTED.search(message)
    if spec.kind == "json" and found:
        keys = ", ".join(repr(k.strip().strip('"')) for k in found.group(1).split(","))
        plural = "s" if "," in found.group(1) else ""
        return f"{spec.field}: unsupported JSON schema keyword{plural} {keys}"
    what = {"json": "JSON schema", "json_object": "JSON object grammar"}.get(spec.kind, spec.kind)
    return f"{spec.field}: invalid {what}: {message}"
