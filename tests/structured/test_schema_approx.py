"""Keywords the grammar library does not implement (tinyserve/structured/schema_approx.py):
every narrowing is sound (each instance of the narrowed schema satisfies the schema as
written, checked by jsonschema over every instance of a small domain) and leaves something
to generate; the library compiles what comes out; the check after generation names the
keyword an answer breaks."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest

from tinyserve.structured.schema_approx import (
    KEYWORDS,
    approximate,
    final_check,
    needs_final_check,
    strip_lookaround,
    uses_keywords,
)
from tinyserve.structured.schema_fixes import fix_schema
from tinyserve.structured.spec import StructuredOutputSpec

_OBJ = {"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [1, 2]},
                                         "c": {"type": "boolean"}}}  # fmt: skip
_ARR = {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3}

# Narrowed (sound, so no check after can fail on what the grammar allows).
NARROWED = [
    {**_OBJ, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    {**_OBJ, "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
     "then": {"required": ["b"]}, "else": {"required": ["c"]}},
    {**_OBJ, "if": False, "then": {"required": ["a"]}, "else": {"required": ["c"]}},
    {**_OBJ, "required": ["a"], "not": {"required": ["a", "b"]}},
    {**_OBJ, "not": {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}},
    {"type": ["string", "integer", "null"], "not": {"type": "integer"}, "maxLength": 1},
    {"not": {"type": ["number", "string", "object", "array"]}},
    {**_ARR, "contains": {"const": 3}},
    {**_ARR, "contains": {"const": 2}, "minContains": 2},
    {**_OBJ, "dependentRequired": {"a": ["b"]}},
    {**_OBJ, "required": ["a"], "dependentRequired": {"a": ["b", "c"]}},
    {**_OBJ, "dependencies": {"a": ["c"], "b": {"properties": {"c": {"const": True}}}}},
    {**_OBJ, "required": ["b"], "dependentSchemas": {"b": {"required": ["a"]}}},
    {"type": "object", "properties": {"x": {**_OBJ, "not": {"required": ["c"]}}},
     "required": ["x"]},
    {**_OBJ, "minProperties": 2},
    {**_OBJ, "required": ["c"], "minProperties": 2},
    # a tagged union written as conditionals (GitHub issue forms, Minecraft loot tables)
    {**_OBJ, "allOf": [
        {"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
        {"if": {"properties": {"a": {"const": 2}}}, "then": {"required": ["c"]},
         "else": {"properties": {"c": {"const": False}}}}]},
]  # fmt: skip


def _domain():
    """Every instance the schemas above can tell apart: small objects, arrays and leaves."""
    leaves = [None, True, False, 0, 1, 2, 3, 1.5, "", "x", "xy"]
    objects = []
    for keys in itertools.chain.from_iterable(itertools.combinations("abc", r) for r in range(4)):
        values = [[1, 2, True] for _ in keys]
        objects += [dict(zip(keys, vs, strict=True)) for vs in itertools.product(*values)]
    arrays = [list(t) for r in range(4) for t in itertools.product([1, 2, 3], repeat=r)]
    nested = [{"x": o} for o in objects]
    return leaves + objects + arrays + nested


DOMAIN = _domain()


def _keys(node) -> set:
    if isinstance(node, list):
        return set().union(*map(_keys, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    return set(node) | set().union(*(_keys(v) for v in node.values()))


def _valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


@pytest.mark.parametrize("schema", NARROWED, ids=lambda s: ",".join(sorted(KEYWORDS & s.keys())))
def test_narrowing_is_sound_and_satisfiable(schema):
    narrowed = approximate(schema)
    assert not KEYWORDS - {"minProperties", "maxProperties"} & _keys(narrowed), narrowed
    inside = [v for v in DOMAIN if _valid(narrowed, v)]
    assert inside, f"nothing satisfies {narrowed}"
    broken = [v for v in inside if not _valid(schema, v)]
    assert not broken, f"{narrowed} lets through {broken[:3]}"


@pytest.mark.parametrize("schema", NARROWED, ids=lambda s: ",".join(sorted(KEYWORDS & s.keys())))
def test_the_library_compiles_the_narrowed_schema(backend, schema):
    backend.compile(StructuredOutputSpec.json_schema(schema))


def test_the_input_is_not_changed_and_data_is_not_read_as_schema():
    schema = {"type": "object", "properties": {"not": {"const": {"uniqueItems": True}}},
              "uniqueItems": True}  # fmt: skip
    before = json.dumps(schema)
    out = approximate(schema)
    assert json.dumps(schema) == before
    assert out["properties"]["not"] == {"const": {"uniqueItems": True}}
    assert "uniqueItems" not in out


@pytest.mark.parametrize(
    "schema, answer, keyword",
    [
        ({"type": "array", "uniqueItems": True}, "[1, 1]", "uniqueItems"),
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, '{"b": 1}', "propertyNames"),
        ({"type": "array", "contains": {"const": 1}, "maxContains": 1}, "[1, 1]", "contains"),
        ({"not": {"const": "x"}}, '"x"', "not"),
        ({**_OBJ, "maxProperties": 1}, '{"a": 1, "b": 2}', "maxProperties"),
        ({"type": "object", "properties": {"q": {"type": "array", "uniqueItems": True}}},
         '{"q": [true, true]}', "uniqueItems"),
        # number bounds past 2^53: the library read them as floats (2^53 + 1 let 2^53 by),
        # or as an i64 (2^64 - 6 let 2^63 - 1 by): 200s that broke the schema
        ({"type": "integer", "minimum": 2**53 + 1, "maximum": 2**53 + 1}, str(2**53),
         "minimum"),
        ({"type": "integer", "minimum": 2**64 - 6}, str(2**63 - 1), "minimum"),
        ({"type": "object", "properties": {"id": {"type": "integer", "maximum": -(2**60)}}},
         '{"id": -1152921504606846975}', "maximum"),
    ],
)  # fmt: skip
def test_the_check_after_names_the_broken_keyword(schema, answer, keyword):
    text = json.dumps(schema)
    assert needs_final_check(text)
    why = final_check(text, answer)
    assert why is not None and repr(keyword) in why


def test_valid_answers_pass_the_check_and_plain_schemas_need_none():
    text = json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    assert final_check(text, "[1, 2, 3]") is None
    assert "not JSON" in final_check(text, "[1, 2")
    assert not needs_final_check(json.dumps({"type": "object", "properties": {"not": {}}}))
    assert not needs_final_check(json.dumps({"type": "integer", "minimum": 2**53}))
    assert (
        final_check(json.dumps({"type": "integer", "minimum": 2**53 + 1}), str(2**53 + 1)) is None
    )


def test_fix_schema_applies_the_narrowing(backend, smollm2_tokenizer):
    """Through the backend: the conditional's ``then`` is required, the forbidden property
    is refused."""
    schema = {**_OBJ, "additionalProperties": False, "required": ["a"],
              "not": {"required": ["a", "c"]}, "if": {}, "then": {"required": ["b"]}}  # fmt: skip
    assert "not" not in fix_schema(schema)
    compiled = backend.compile(StructuredOutputSpec.json_schema(schema))

    def takes(text):
        m = backend.matcher(compiled)
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        return m.accept_tokens(ids) and m.accept_tokens([backend.eos_token_ids[0]])

    assert takes('{"a": 1, "b": 2}')
    assert not takes('{"a": 1}')  # then: b required
    assert not takes('{"a": 1, "b": 2, "c": true}')  # not both a and c


@pytest.mark.parametrize(
    "pattern, inside, outside",
    [
        ("^(?!plugins$)[a-z0-9][a-z0-9+-]*$", ["a1", "plugin"], ["plugins"]),
        ("^(?=[^!]+$)(?=(.*[0-9])).+$", ["a1"], ["ab", "a!1"]),
        ("^a(?<=a)[(?!]b$", ["a(b", "a!b"], []),
    ],
)
def test_look_arounds_widen_and_are_checked_after(backend, pattern, inside, outside):
    """Without its look-arounds a pattern matches everything it did (and the strings it
    refused); the schema is then checked after: those strings break it."""
    import re

    wide = strip_lookaround(pattern)
    assert len(wide) < len(pattern)
    for text in inside + outside:
        assert not re.search(pattern, text) or re.search(wide, text)
    schema = {"type": "string", "pattern": pattern}
    backend.compile(StructuredOutputSpec.json_schema(schema))
    for text in outside:
        assert "'pattern'" in final_check(json.dumps(schema), json.dumps(text))
    for text in inside:
        assert final_check(json.dumps(schema), json.dumps(text)) is None
    keyed = {"type": "object", "patternProperties": {pattern: {}}, "additionalProperties": False}
    assert needs_final_check(json.dumps(keyed))
    backend.compile(StructuredOutputSpec.json_schema(keyed))


def test_groups_of_definitions_are_reached_through_their_refs():
    """SchemaStore's travis.json keeps definitions in groups ("#/definitions/group/x")."""
    schema = {"definitions": {"group": {"x": {"type": "array", "uniqueItems": True}}},
              "$ref": "#/definitions/group/x"}  # fmt: skip
    assert uses_keywords(schema)
    assert "uniqueItems" not in json.dumps(approximate(schema))


def test_the_check_after_generation_reads_keywords_as_the_grammar_does():
    """The bug hunt's valid answers that the check refused (400s): pydantic money fields
    (multipleOf 0.01: jsonschema's float division says 19.99 is not a multiple), an ECMA /
    Rust pattern Python's re cannot read (\\p{Lu}), a draft-7 tuple `items` without a
    $schema (an AttributeError inside jsonschema) and a 330-digit number (OverflowError).
    Invalid answers are still refused."""
    schema = json.dumps({"type": "object", "required": ["kind"], "properties": {
        "price": {"type": "number", "multipleOf": 0.01},
        "name": {"type": "string", "pattern": r"^\p{Lu}\p{Ll}+$"},
        "pt": {"type": "array", "items": [{"type": "integer"}, {"type": "string"}]},
        "qty": {"type": "number", "multipleOf": 0.5},
        "kind": {"oneOf": [{"const": "a"}, {"const": "b"}]}}})  # fmt: skip
    valid = (
        '{"price": 19.99, "name": "Zoë", "pt": [1, "x"], "qty": 9' + "7" * 329 + ', "kind": "a"}'
    )
    assert final_check(schema, valid) is None
    for bad, keyword in (('{"price": 19.995, "kind": "a"}', "multipleOf"),
                         ('{"name": "zoë", "kind": "a"}', "pattern"),
                         ('{"pt": ["x", 1], "kind": "a"}', "type"),
                         ('{"qty": 1.25, "kind": "a"}', "multipleOf")):  # fmt: skip
        assert f"'{keyword}'" in final_check(schema, bad), bad
