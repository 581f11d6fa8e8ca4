"""Objects closed to their declared properties (tinyserve/structured/strict.py), the default
for ``response_format`` and tool arguments: only ever narrower than the schema as written
(checked over every instance of a small domain), never closed where properties add up
across schemas (allOf, conditionals, a $ref or union beside properties, and what their parts
refer to), and still satisfiable where ``required`` names an undeclared property."""

from __future__ import annotations

import itertools

import jsonschema
import pytest

from tinyserve.entrypoints.serving import format_constraint
from tinyserve.structured.spec import StructuredOutputSpec
from tinyserve.structured.strict import closed_objects

_P = {"a": {"type": "integer"}, "b": {"type": "integer"}}
CASES = [
    {"type": "object", "properties": _P},
    {"type": "object", "properties": {"a": _P["a"]}, "allOf": [{"properties": {"b": _P["b"]}}]},
    {"$defs": {"base": {"type": "object", "properties": {"a": _P["a"]}}},
     "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": _P["b"]}, "required": ["b"]}]},
    {"definitions": {"g": {"base": {"properties": {"a": _P["a"]}}}},
     "$ref": "#/definitions/g/base", "properties": {"b": _P["b"]}, "required": ["a", "b"]},
    {"type": "object", "properties": {"a": _P["a"]},
     "if": {"properties": {"a": {"const": 1}}}, "then": {"properties": {"b": _P["b"]}}},
    {"type": "object", "properties": {"a": _P["a"]}, "required": ["a", "b"]},
    {"anyOf": [{"properties": {"a": _P["a"]}, "required": ["a"]},
               {"properties": {"b": _P["b"]}, "required": ["b"]}]},
]  # fmt: skip
DOMAIN = [
    dict(zip(keys, values, strict=True))
    for r in range(3)
    for keys in itertools.combinations("abc", r)
    for values in itertools.product([1, 2], repeat=r)
]


def _valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


@pytest.mark.parametrize("schema", CASES)
def test_closing_only_narrows_and_leaves_something(schema):
    closed = closed_objects(schema)
    inside = [v for v in DOMAIN if _valid(closed, v)]
    assert inside, f"nothing satisfies {closed}"
    assert all(_valid(schema, v) for v in inside)


def test_what_closing_refuses_and_keeps():
    plain, composed = closed_objects(CASES[0]), closed_objects(CASES[1])
    assert not _valid(plain, {"a": 1, "c": 1}) and _valid(CASES[0], {"a": 1, "c": 1})
    assert _valid(composed, {"a": 1, "b": 2})  # b is declared by the allOf part
    assert _valid(closed_objects(CASES[2]), {"a": 1, "b": 2})  # by the part the $ref names
    assert _valid(closed_objects(CASES[3]), {"a": 1, "b": 2})  # a group of definitions
    assert _valid(closed_objects(CASES[5]), {"a": 1, "b": True})  # required, undeclared
    union = closed_objects(CASES[6])
    assert _valid(union, {"a": 1}) and not _valid(union, {"a": 1, "c": 1})


def test_response_format_is_closed_unless_strict_is_false(backend):
    schema = {"type": "object", "properties": _P}
    for strict in (None, True):
        so = format_constraint("json_schema", schema, "response_format", "x", strict)
        assert so.json["additionalProperties"] is False
    so = format_constraint("json_schema", schema, "response_format", "x", False)
    assert so.json == schema
    backend.compile(StructuredOutputSpec.json_schema(closed_objects(schema)))
