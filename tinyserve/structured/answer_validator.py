"""The validator the check after generation (schema_approx.final_check) runs an answer
through: jsonschema's, for the schema's draft, with the grammar's semantics where Python
reads a keyword differently."""

from __future__ import annotations

import functools
import json
from fractions import Fraction

import regex


@functools.lru_cache(maxsize=32)
def answer_validator(schema_text: str):
    """jsonschema's validator for the schema's draft (2020-12 unless it says; draft 7 for
    list-form ``items`` without a ``$schema``), with the grammar's semantics for the two
    keywords Python reads differently: ``multipleOf`` exactly in decimal (19.99 is a multiple
    of 0.01; jsonschema divides floats, says it is not, and overflows on a 330-digit
    number) and ``pattern`` in the ``regex`` module (\\p{L}, named groups: ECMA / Rust syntax
    the grammar took, which ``re`` cannot read)."""
    import jsonschema

    schema = json.loads(schema_text)
    default = (
        jsonschema.Draft7Validator if _tuple_items(schema) else jsonschema.Draft202012Validator
    )
    cls = jsonschema.validators.validator_for(schema, default=default)
    cls = jsonschema.validators.extend(cls, {"multipleOf": _multiple_of, "pattern": _pattern})
    return cls(schema)


def _tuple_items(node) -> bool:
    if isinstance(node, dict):
        return isinstance(node.get("items"), list) or any(map(_tuple_items, node.values()))
    return isinstance(node, list) and any(map(_tuple_items, node))


def _multiple_of(validator, step, instance, schema):
    from jsonschema import ValidationError

    if not validator.is_type(instance, "number") or isinstance(instance, bool):
        return
    try:
        ok = Fraction(str(instance)) % Fraction(str(step)) == 0
    except (ValueError, ZeroDivisionError, OverflowError):
        return
    if not ok:
        yield ValidationError(f"{instance!r} is not a multiple of {step}")


def _pattern(validator, pattern, instance, schema):
    from jsonschema import ValidationError

    if not validator.is_type(instance, "string"):
        return
    try:
        found = regex.search(pattern, instance)
    except regex.error:  # the grammar compiled it: enforced there
        return
    if found is None:
        yield ValidationError(f"{instance!r} does not match {pattern!r}")
