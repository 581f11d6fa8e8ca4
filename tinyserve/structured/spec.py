"""What a request asks its output to match: a frozen, hashable, torch-free value.

A spec is ``(kind, value)`` plus the request field it came from (``field``, used to start
every error message so the HTTP layer can return a 400 that points at it):

===============  =============================================================
kind             value
===============  =============================================================
``json``         the JSON schema as canonical JSON text (no spaces; key order kept)
``json_object``  "" (any JSON object)
``regex``        the pattern (Rust ``regex`` syntax, anchored at both ends)
``choice``       a JSON list of strings: the output is exactly one of them
``grammar``      a Lark grammar (llguidance's dialect), or GBNF/EBNF with ``::=``
===============  =============================================================

``key`` identifies the compiled grammar in the compile cache: two specs with the same key
compile to the same thing (the same text asked for through the same field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
DEFAULT_FIELD = "response_format"


def canonical_json(value: Any) -> str:
    """Compact JSON text. Keys keep their order: the grammar emits properties in the order
    the schema lists them, so two orders are two different specs."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class StructuredOutputSpec:
    kind: str
    value: str = ""
    field: str = DEFAULT_FIELD

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.field}: unknown structured output kind {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"{self.field}: the {self.kind} spec must be given as text")
        if self.kind in ("regex", "grammar") and not self.value:
            raise ValueError(f"{self.field}: the {self.kind} must not be empty")

    @property
    def key(self) -> str:
        return f"{self.kind}\x00{self.field}\x00{self.value}"

    # ------------------------------------------------------------------ constructors
    @classmethod
    def json_schema(cls, schema: Any, field: str = DEFAULT_FIELD) -> StructuredOutputSpec:
        """From a schema (a dict, ``True``, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"{field}: the JSON schema is not valid JSON ({e})") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError(f"{field}: the JSON schema must be an object")
        return cls("json", canonical_json(schema), field)

    @classmethod
    def json_object(cls, field: str = DEFAULT_FIELD) -> StructuredOutputSpec:
        return cls("json_object", "", field)

    @classmethod
    def regex(cls, pattern: str, field: str = DEFAULT_FIELD) -> StructuredOutputSpec:
        return cls("regex", pattern, field)

    @classmethod
    def choice(cls, choices: list[str], field: str = DEFAULT_FIELD) -> StructuredOutputSpec:
        if (
            not isinstance(choices, (list, tuple))
            or not choices
            or not all(isinstance(c, str) for c in choices)
        ):
            raise ValueError(f"{field}: choice must be a non-empty list of strings")
        return cls("choice", canonical_json(list(choices)), field)

    @classmethod
    def grammar(cls, text: str, field: str = DEFAULT_FIELD) -> StructuredOutputSpec:
        return cls("grammar", text, field)
