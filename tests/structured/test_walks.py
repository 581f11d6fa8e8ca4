"""Random walks through compiled grammars: every token drawn among the allowed ones, several
seeds, until the grammar ends; the text must parse and validate (jsonschema), match the
regex, or be one of the choices."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tinyserve.structured.spec import StructuredOutputSpec

SEEDS = range(4)

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
ARRAYS = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 2,
            "maxItems": 4,
        },  # fmt: skip
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    },
    "required": ["tags", "scores"],
    "additionalProperties": False,
}
ENUMS_AND_PATTERNS = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue", 7, None]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "kind": {"const": "fixed"},
    },
    "required": ["color", "code", "kind"],
    "additionalProperties": False,
}
RANGES = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 10, "maximum": 20},
        "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "big": {"type": "integer", "minimum": -5000},
    },
    "required": ["n", "x", "big"],
    "additionalProperties": False,
}
TREE = {  # recursive $ref through $defs, the shape of a file tree or a comment thread
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["value"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
LINKED_LIST = {  # draft-07 style: definitions, a $ref to the root, oneOf with null
    "definitions": {
        "item": {
            "type": "object",
            "properties": {
                "v": {"type": "string", "maxLength": 4},
                "next": {"oneOf": [{"$ref": "#/definitions/item"}, {"type": "null"}]},
            },
            "required": ["v", "next"],
            "additionalProperties": False,
        }  # fmt: skip
    },
    "$ref": "#/definitions/item",
}
COMBINATORS = {
    "type": "object",
    "properties": {
        "id": {"anyOf": [{"type": "integer"}, {"type": "string", "format": "uuid"}]},
        "when": {"type": "string", "format": "date"},
        "both": {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                {"type": "object"},
            ]
        },  # fmt: skip
    },
    "required": ["id", "when", "both"],
    "additionalProperties": False,
}

SCHEMAS = {
    "nested": NESTED,
    "arrays": ARRAYS,
    "enums_patterns": ENUMS_AND_PATTERNS,
    "ranges": RANGES,
    "tree": TREE,
    "linked_list": LINKED_LIST,
    "combinators": COMBINATORS,
}


def _text(tokenizer, ids):
    return tokenizer.decode([t for t in ids if t != tokenizer.eos_token_id])


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_walks_validate(backend, walk, smollm2_tokenizer, closing_ids, name):
    schema = SCHEMAS[name]
    compiled = backend.compile(StructuredOutputSpec.json_schema(schema))
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for seed in SEEDS:
        text = _text(smollm2_tokenizer, walk(backend, compiled, seed, closing_ids))
        jsonschema.validate(json.loads(text), schema, format_checker=checker)


def test_json_object_walks_are_objects(backend, walk, smollm2_tokenizer, closing_ids):
    compiled = backend.compile(StructuredOutputSpec.json_object())
    for seed in SEEDS:
        text = _text(smollm2_tokenizer, walk(backend, compiled, seed, closing_ids))
        assert isinstance(json.loads(text), dict), text


def test_regex_walks_match(backend, walk, smollm2_tokenizer):
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    compiled = backend.compile(StructuredOutputSpec.regex(pattern))
    for seed in SEEDS:
        text = _text(smollm2_tokenizer, walk(backend, compiled, seed))
        assert re.fullmatch(pattern, text), text


def test_choice_walks_pick_one(backend, walk, smollm2_tokenizer):
    choices = ["positive", "negative", "neutral", 'a "quoted" one\n', "pos"]
    compiled = backend.compile(StructuredOutputSpec.choice(choices))
    seen = set()
    for seed in range(12):
        text = _text(smollm2_tokenizer, walk(backend, compiled, seed))
        assert text in choices, text
        seen.add(text)
    assert len(seen) > 1


@pytest.mark.parametrize(
    "grammar",
    [
        'start: expr\nexpr: NUM | expr OP expr | "(" expr ")"\nNUM: /[0-9]{1,3}/\nOP: "+" | "*"',
        'root ::= "yes" | "no" | num\nnum ::= [0-9]+',  # GBNF
    ],
    ids=["lark", "gbnf"],
)
def test_grammar_walks_match(backend, walk, smollm2_tokenizer, grammar):
    compiled = backend.compile(StructuredOutputSpec.grammar(grammar))
    allowed = re.compile(r"[0-9+*()]+") if "expr" in grammar else re.compile(r"yes|no|[0-9]+")
    closing = torch.zeros(len(smollm2_tokenizer), dtype=torch.bool)
    closing[smollm2_tokenizer.eos_token_id] = True
    for seed in SEEDS:
        text = _text(smollm2_tokenizer, walk(backend, compiled, seed, closing))
        assert allowed.fullmatch(text), text
