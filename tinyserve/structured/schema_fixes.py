"""Rewrites of a JSON schema before llguidance compiles it, around the library's bugs.
Torch-free. Each rewrite keeps every output valid against the schema as written (it may only
narrow what is allowed, by as little as it can).

Exclusive number bounds (llguidance 1.9.1): a ``number`` range whose exclusive bound is an
integer ``x`` and whose other bound lies less than 1 away (``exclusiveMinimum: 40, maximum:
40.5``; ``minimum: -0.5, exclusiveMaximum: 0``) also accepts the bare integer ``x`` (and
``-0`` for 0), which the bound excludes. Found by tests/engine/test_structured_fuzz.py. Such
a bound becomes the inclusive one a hair inside (``minimum: 40.00000004``): a value in that
hair is the only thing lost.

Tuples written with 2020-12's ``prefixItems`` and draft 7's ``additionalItems`` (an
LLM-written or hand-merged schema): the library ignored ``prefixItems`` then (``["a"]`` for an
integer first item). ``additionalItems`` becomes 2020-12's ``items`` where there is none (a
narrowing: 2020-12 ignores ``additionalItems``; draft 7 ignores ``prefixItems``), else dropped.

Dates and times (``format: "date"``, ``"date-time"``, ``"time"``, ``"duration"``): llguidance
takes RFC 3339's shapes, digit by digit: year 0000, February 29 of any year (2023-02-29),
second 60, any number of digits in a duration's parts. Python's ``date.fromisoformat`` and
pydantic (what jsonschema's format checker and most clients parse them with: a pydantic
model's ``datetime`` field is ``format: date-time``) refuse those, so a client's parse of a
200 failed. Such a string schema without a pattern of its own becomes, by a pattern, values
pydantic takes (and Python >= 3.11's ``fromisoformat``; Python has no duration parser):
years 0001-9999 with the leap-day rule written out, seconds 00-59 with at most 6 digits of
fraction, ``T`` and ``Z`` in capitals, offsets to +-23:59; durations as RFC 3339's appendix
A writes them, each number at most 4 digits (within pydantic's timedelta).
"""

from __future__ import annotations

import math

from tinyserve.structured.schema_approx import approximate

# Keys whose values are data, not subschemas: never rewritten.
DATA_KEYS = frozenset({"const", "enum", "default", "examples"})
# Keys whose values map names to subschemas (a property named "format" is no keyword).
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                        "dependentSchemas"})  # fmt: skip
_REL_EPS = 1e-9


def fix_schema(schema, narrow: bool = True):
    """``schema`` with the rewrites applied (a new object; the input is not changed): the
    keywords the library does not implement narrowed or dropped (schema_approx.py), then
    the library's bugs and gaps worked around."""
    return _fix(approximate(schema, narrow))


def _fix(schema):
    if isinstance(schema, list):
        return [_fix(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in DATA_KEYS else _fix_map(v) if k in _NAME_MAPS else _fix(v)
           for k, v in schema.items()}  # fmt: skip
    if _number(out.get("multipleOf")) and out["multipleOf"] <= 0:  # the library took -2
        raise ValueError(f"multipleOf must be greater than 0, got {out['multipleOf']}")
    if out.get("type") != "integer":
        _tighten(out, "exclusiveMinimum", "minimum", ("maximum", "exclusiveMaximum"), +1)
        _tighten(out, "exclusiveMaximum", "maximum", ("minimum", "exclusiveMinimum"), -1)
    if (
        isinstance(out.get("format"), str)
        and out["format"] in FORMAT_PATTERNS
        and ("pattern" not in out)
    ):
        out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
    elif isinstance(out.get("format"), str) and out["format"] not in _FORMATS:
        _format(out)
    if "prefixItems" in out and "additionalItems" in out:  # draft 7's word in 2020-12's
        extra = out.pop("additionalItems")  # tuple: the library then dropped prefixItems
        out.setdefault("items", extra)
    if isinstance(out.get("$schema"), str):
        _dialect(out)
    return out


def _fix_map(names):
    """A map of names to schemas (``properties``, ``$defs``, ...): its values fixed, not
    itself, where a property may be called ``format`` or ``additionalItems``."""
    if not isinstance(names, dict):
        return _fix(names)
    return {name: _fix(s) for name, s in names.items()}


def _format(schema: dict) -> None:
    """A format the library does not know: its subset the library does know (every URI is a
    URI reference and an IRI; an ASCII address or host name is an internationalised one), a
    JSON pointer by its pattern, pydantic's own (``uuid4``, ``ipvanyaddress``: a model's
    ``UUID4`` / ``IPvAnyAddress`` fields took any string, which its parse then refused) as
    what pydantic takes, else dropped (an annotation since draft 2019-09)."""
    name = schema.pop("format")
    if name in _NARROWER:
        schema["format"] = _NARROWER[name]
    elif name == "json-pointer" and "pattern" not in schema:
        schema["pattern"] = "^(/([^~/]|~[01])*)*$"
    elif name in UUID_PATTERNS and "pattern" not in schema:  # pydantic's UUID1, UUID3-8: the
        schema["pattern"] = UUID_PATTERNS[name]  # version nibble, RFC 4122's variant
    elif name == "ipvanyaddress" and "anyOf" not in schema:  # pydantic's IPvAnyAddress
        schema["anyOf"] = [{"format": "ipv4"}, {"format": "ipv6"}]


def _dialect(schema: dict) -> None:
    """``$schema`` as the library's registry names it (it fetches nothing and refuses
    ``https://json-schema.org/draft-04/schema`` though it knows the draft); unknown: dropped."""
    url = schema["$schema"].rstrip("#")
    found = next((d for d in _DIALECTS if d in url), None)
    if found is None:
        del schema["$schema"]
    else:
        schema["$schema"] = _DIALECTS[found]


# The formats llguidance 1.9.1 implements; the known ones it does not, by a subset it does.
_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4",
                      "ipv6", "uuid", "uri"})  # fmt: skip
_NARROWER = {"uri-reference": "uri", "iri": "uri", "iri-reference": "uri",
             "idn-email": "email", "idn-hostname": "hostname"}  # fmt: skip
_HEX = "[0-9a-fA-F]"
UUID_PATTERNS = {
    f"uuid{v}": rf"^{_HEX}{{8}}-{_HEX}{{4}}-{v}{_HEX}{{3}}-[89abAB]{_HEX}{{3}}-{_HEX}{{12}}$"
    for v in (1, 3, 4, 5, 6, 7, 8)
}
_DIALECTS = {
    "draft-04": "http://json-schema.org/draft-04/schema#",
    "draft-06": "http://json-schema.org/draft-06/schema#",
    "draft-07": "http://json-schema.org/draft-07/schema#",
    "draft/2019-09": "https://json-schema.org/draft/2019-09/schema",
    "draft/2020-12": "https://json-schema.org/draft/2020-12/schema",
}
_YEAR = r"([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (r"((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
              r"|02-(0[1-9]|1[0-9]|2[0-8]))")  # fmt: skip
_DATE = rf"({_YEAR}-{_MONTH_DAY}|{_LEAP}-02-29)"
_TIME = (
    r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
)
_N = "[0-9]{1,4}"
_DUR_TIME = rf"T({_N}H({_N}M({_N}S)?)?|{_N}M({_N}S)?|{_N}S)"
_DUR_DATE = rf"({_N}D|{_N}M({_N}D)?|{_N}Y({_N}M({_N}D)?)?)"
DATE_PATTERN = rf"^{_DATE}$"
FORMAT_PATTERNS = {
    "date": DATE_PATTERN,
    "date-time": rf"^{_DATE}T{_TIME}$",
    "time": rf"^{_TIME}$",
    "duration": rf"^P({_DUR_DATE}({_DUR_TIME})?|{_DUR_TIME}|{_N}W)$",
}


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
