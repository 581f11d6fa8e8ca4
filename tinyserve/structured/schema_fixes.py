"""Rewrites of a JSON schema before llguidance compiles it, around the library's bugs.
Torch-free. Each rewrite keeps every output valid against the schema as written (it may only
narrow what is allowed, by as little as it can).

Exclusive number bounds (llguidance 1.9.1): a ``number`` range whose exclusive bound is an
integer ``x`` and whose other bound lies less than 1 away (``exclusiveMinimum: 40, maximum:
40.5``; ``minimum: -0.5, exclusiveMaximum: 0``) also accepts the bare integer ``x`` (and
``-0`` for 0), which the bound excludes. Found by tests/engine/test_structured_fuzz.py. Such
a bound becomes the inclusive one a hair inside (``minimum: 40.00000004``): a value in that
hair is the only thing lost.
"""

from __future__ import annotations

import math

# Keys whose values are data, not subschemas: never rewritten.
_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})
_REL_EPS = 1e-9


def fix_schema(schema):
    """``schema`` with the rewrites applied (a new object; the input is not changed)."""
    if isinstance(schema, list):
        return [fix_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYS else fix_schema(v)) for k, v in schema.items()}
    if out.get("type") != "integer":
        _tighten(out, "exclusiveMinimum", "minimum", ("maximum", "exclusiveMaximum"), +1)
        _tighten(out, "exclusiveMaximum", "maximum", ("minimum", "exclusiveMinimum"), -1)
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _tighten(schema: dict, exclusive: str, inclusive: str, others: tuple, sign: int) -> None:
    """Replace an integral ``exclusive`` bound less than 1 from the nearest opposite bound by
    the ``inclusive`` bound a hair inside it (strictly between the bound and that one)."""
    x = schema.get(exclusive)
    if not _number(x) or x != int(x):
        return
    opposite = [schema[k] for k in others if _number(schema.get(k))]
    if not opposite:
        return
    other = min(opposite) if sign > 0 else max(opposite)
    gap = (other - x) * sign
    if not 0 < gap < 1:
        return  # empty range (left to the library), or wide enough to be compiled right
    inside = x + sign * min(gap / 2, _REL_EPS * max(1.0, abs(x)))
    if inside == x or (inside - other) * sign >= 0:
        return  # no float strictly between: leave it
    current = schema.get(inclusive)
    del schema[exclusive]
    if _number(current) and (current - inside) * sign > 0:
        return  # the inclusive bound is tighter: the exclusive one was redundant
    schema[inclusive] = inside
