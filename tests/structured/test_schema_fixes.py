"""The schema rewrites around llguidance's bugs (tinyserve/structured/schema_fixes.py):
outputs the library would wrongly allow are refused through the backend, and the rewrite
itself is exact where it can be and leaves everything else alone."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from tinyserve.structured.schema_fixes import fix_schema
from tinyserve.structured.spec import StructuredOutputSpec

# (schema, texts that must be refused, texts that must be accepted). Found by the engine fuzz
# (tests/engine/test_structured_fuzz.py): llguidance 1.9.1 took the excluded integer.
EXCLUSIVE_CASES = [
    ({"exclusiveMinimum": 40.0, "maximum": 40.5}, ["40", "39"], ["40.1", "40.5", "40.25"]),
    ({"exclusiveMinimum": 40, "exclusiveMaximum": 40.5}, ["40", "40.5"], ["40.4"]),
    ({"exclusiveMinimum": 0, "maximum": 0.5}, ["0", "-0"], ["0.1", "0.5"]),
    ({"exclusiveMinimum": 5, "maximum": 5.0001}, ["5"], ["5.00005"]),
    ({"minimum": -2.5, "exclusiveMaximum": -2}, ["-2"], ["-2.5", "-2.1"]),
    ({"minimum": -0.5, "exclusiveMaximum": 0}, ["-0", "0"], ["-0.5", "-0.25"]),
    ({"exclusiveMinimum": -3, "exclusiveMaximum": -2.5}, ["-3", "-2.5"], ["-2.75"]),
]


def _takes(backend, compiled, tokenizer, text: str) -> bool:
    """The grammar takes all of ``text`` and may end there."""
    matcher = backend.matcher(compiled)
    if not matcher.accept_tokens(tokenizer.encode(text, add_special_tokens=False)):
        return False
    return matcher.is_terminated() or matcher.accept_tokens([backend.eos_token_ids[0]])


@pytest.mark.parametrize("bounds, refused, accepted", EXCLUSIVE_CASES)
def test_exclusive_integer_bound_near_the_other_bound_is_kept(
    backend, smollm2_tokenizer, bounds, refused, accepted
):
    schema = {"type": "object", "properties": {"v": {"type": "number", **bounds}},
              "required": ["v"], "additionalProperties": False}  # fmt: skip
    compiled = backend.compile(StructuredOutputSpec.json_schema(schema))
    for text in refused:
        assert not _takes(backend, compiled, smollm2_tokenizer, f'{{"v": {text}}}'), text
    for text in accepted:
        assert _takes(backend, compiled, smollm2_tokenizer, f'{{"v": {text}}}'), text


def test_rewrite_narrows_by_a_hair_and_only_where_needed():
    fixed = fix_schema({"type": "number", "exclusiveMinimum": 40, "maximum": 40.5})
    assert "exclusiveMinimum" not in fixed and 40 < fixed["minimum"] < 40.000001
    fixed = fix_schema({"exclusiveMaximum": 0, "minimum": -0.5})
    assert "exclusiveMaximum" not in fixed and -0.000001 < fixed["maximum"] < 0
    untouched = [
        {"type": "number", "exclusiveMinimum": 40, "maximum": 45},  # compiled right
        {"type": "number", "exclusiveMinimum": 40.5, "maximum": 40.9},  # not an integer
        {"type": "number", "exclusiveMinimum": 40},  # no other bound
        {"type": "integer", "exclusiveMinimum": 40, "maximum": 40.5},
        {"const": {"exclusiveMinimum": 1, "maximum": 1.5}},  # data, not a schema
        {"enum": [{"exclusiveMaximum": 0, "minimum": -0.5}]},
    ]
    for schema in untouched:
        assert fix_schema(schema) == schema
    # Nested subschemas are rewritten; property order is kept; the input is not changed.
    schema = {"type": "object", "properties": {"b": {"type": "string"},
              "a": {"anyOf": [{"type": "number", "exclusiveMinimum": 1, "maximum": 1.5}]}}}  # fmt: skip
    fixed = fix_schema(schema)
    assert list(fixed["properties"]) == ["b", "a"]
    assert "minimum" in fixed["properties"]["a"]["anyOf"][0]
    assert "exclusiveMinimum" in schema["properties"]["a"]["anyOf"][0]


def test_random_walks_over_random_number_ranges_stay_in_range(
    backend, smollm2_tokenizer, walk, closing_ids
):
    """Random bounds (inclusive / exclusive, integral / not, narrow / wide, both signs): every
    walk to the end is a number the schema takes. Without the rewrite ~3% of such walks
    landed on an excluded integer."""
    rng = random.Random(5)
    for i in range(80):
        lo = rng.choice([0, -1, 1, 5, -5, 0.5, -0.5, 2.25, -2.25, 10, -100, 0.001])
        hi = round(lo + rng.choice([0.001, 0.1, 0.5, 0.75, 1, 1.5, 10]), 4)
        bounds = {rng.choice(["minimum", "exclusiveMinimum"]): lo,
                  rng.choice(["maximum", "exclusiveMaximum"]): hi}  # fmt: skip
        schema = {"type": "object", "properties": {"v": {"type": "number", **bounds}},
                  "required": ["v"], "additionalProperties": False}  # fmt: skip
        compiled = backend.compile(StructuredOutputSpec.json_schema(schema))
        ids = walk(backend, compiled, seed=i, prefer=closing_ids, max_steps=300)
        text = smollm2_tokenizer.decode([t for t in ids if t not in backend.eos_token_ids])
        jsonschema.validate(json.loads(text), schema)


def test_dates_are_the_ones_python_parses(backend, smollm2_tokenizer):
    """format: date becomes a pattern that takes exactly what date.fromisoformat takes (year
    0000 is RFC 3339's but no Python date), checked on every day of 250 years and of years
    0-29 (leap days, month lengths, the first centuries); a pattern of the schema's own is
    left alone; and the compiled grammar refuses year 0 where the library took it."""
    import datetime
    import re

    from tinyserve.structured.schema_fixes import DATE_PATTERN

    rx = re.compile(DATE_PATTERN)
    for y in [*range(30), *range(1880, 2130), 9999]:
        for m in range(0, 14):
            for d in range(0, 33):
                text = f"{y:04d}-{m:02d}-{d:02d}"
                try:
                    ok = datetime.date.fromisoformat(text) is not None
                except ValueError:
                    ok = False
                assert ok == bool(rx.match(text)), text
    fixed = fix_schema({"type": "string", "format": "date"})
    assert fixed == {"type": "string", "pattern": DATE_PATTERN}
    own = {"type": "string", "format": "date", "pattern": "^2"}
    assert fix_schema(own) == own
    compiled = backend.compile(
        StructuredOutputSpec.json_schema({"type": "string", "format": "date"})
    )
    for text, ok in (('"0000-03-08"', False), ('"2024-02-29"', True), ('"2023-02-29"', False),
                     ('"0001-01-01"', True)):  # fmt: skip
        assert _takes(backend, compiled, smollm2_tokenizer, text) == ok, text


def _time_strings(rng):
    """Times as a model might write them: mostly well-formed, some digits out of range."""
    two = lambda hi: f"{rng.randrange(hi):02d}"  # noqa: E731
    frac = rng.choice(["", "", ".5", ".123456", ".1234567", "."])
    zone = rng.choice(["Z", "z", "", "+01:00", "-23:59", "+24:00", "+05:60", "+0100"])
    return f"{two(26)}:{two(62)}:{two(62)}{frac}{zone}"


@pytest.mark.parametrize("fmt", ["date-time", "time", "duration"])
def test_times_and_durations_are_ones_pydantic_parses(backend, smollm2_tokenizer, fmt):
    """format date-time / time / duration become patterns whose every string pydantic's
    datetime / time / timedelta parse (pydantic models emit these formats for such fields):
    llguidance's own took 2023-02-29, second 60 and durations past timedelta's range. Checked
    over 20k random strings each; the compiled grammar refuses what it took before."""
    import datetime
    import random
    import re

    from pydantic import TypeAdapter

    from tinyserve.structured.schema_fixes import FORMAT_PATTERNS

    rx = re.compile(FORMAT_PATTERNS[fmt])
    parse = TypeAdapter({"date-time": datetime.datetime, "time": datetime.time,
                         "duration": datetime.timedelta}[fmt]).validate_python  # fmt: skip
    rng = random.Random(0)
    taken = 0
    for _ in range(20_000):
        if fmt == "duration":
            parts = [f"{rng.choice([1, 12, 9999, 10**5, 10**9])}{u}"
                     for u in rng.sample("YMWDHS", rng.randrange(1, 4))]  # fmt: skip
            text = "P" + "".join(parts[:1]) + rng.choice(["", "T"]) + "".join(parts[1:])
        else:
            day = f"{rng.choice([1, 2023, 2024, 0])}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 32):02d}"
            text = _time_strings(rng)
            text = f"{day}{rng.choice('TT t')}{text}" if fmt == "date-time" else text
        if rx.match(text):
            taken += 1
            parse(text)  # raises where the pattern took what pydantic refuses
    assert taken > 1000, taken
    compiled = backend.compile(StructuredOutputSpec.json_schema({"type": "string", "format": fmt}))
    cases = {
        "date-time": [("2024-02-29T23:59:59.5+01:00", True), ("2023-02-29T00:00:00Z", False),
                      ("2023-01-01T00:00:60Z", False), ("0000-01-01T00:00:00Z", False)],
        "time": [("12:30:00Z", True), ("23:59:60Z", False)],
        "duration": [("P3DT12H30M5S", True), ("P2W", True), ("P1000000000D", False)],
    }[fmt]  # fmt: skip
    for text, ok in cases:
        assert _takes(backend, compiled, smollm2_tokenizer, json.dumps(text)) == ok, text


def test_prefix_items_beside_additional_items_stay_a_tuple(backend, smollm2_tokenizer):
    """2020-12's prefixItems with draft 7's additionalItems: the library dropped the tuple
    (a string first where an integer must be); now additionalItems is the items after it."""
    tuple_ = {"type": "array", "prefixItems": [{"type": "integer"}, {"enum": ["x"]}],
              "additionalItems": False}  # fmt: skip
    compiled = backend.compile(StructuredOutputSpec.json_schema(tuple_))
    for text, ok in (("[1]", True), ('[1, "x"]', True), ('["a"]', False), ('[1, "x", 2]', False)):
        assert _takes(backend, compiled, smollm2_tokenizer, text) == ok, text
    both = {**tuple_, "items": {"type": "integer"}}  # items already says it: kept
    assert fix_schema(both) == {k: v for k, v in both.items() if k != "additionalItems"}


@pytest.mark.parametrize(
    "fmt, accepted, refused",
    [
        ("uri-reference", ["https://example.org/a"], ["not a uri"]),  # narrowed to uri
        ("idn-email", ["a@b.org"], ["nope"]),  # narrowed to email
        ("json-pointer", ["/a/b~1c", ""], ["a/b", "/a~2"]),  # its pattern
        ("uri-template", ["anything {x}"], []),  # an annotation: dropped
    ],
)
def test_formats_the_library_lacks_are_narrowed_or_dropped(
    backend, smollm2_tokenizer, fmt, accepted, refused
):
    compiled = backend.compile(StructuredOutputSpec.json_schema({"type": "string", "format": fmt}))
    for text in accepted:
        assert _takes(backend, compiled, smollm2_tokenizer, json.dumps(text)), text
    for text in refused:
        assert not _takes(backend, compiled, smollm2_tokenizer, json.dumps(text)), text


@pytest.mark.parametrize(
    "url",
    ["https://json-schema.org/draft-04/schema", "http://json-schema.org/draft/2019-09/schema",
     "http://json-schema.org/schema#", "https://example.org/my-dialect"],
)  # fmt: skip
def test_dialect_urls_the_library_would_fetch_compile(backend, url):
    """llguidance fetches nothing and refuses a "$schema" URL its registry spells otherwise."""
    backend.compile(StructuredOutputSpec.json_schema({"$schema": url, "type": "object"}))


def test_properties_named_like_keywords_are_names(backend):
    """OpenAI's cookbook tool get_current_weather(location, format): a property called
    ``format`` holds a schema, not a format name (fix_schema raised TypeError on it: a 500
    for a template's own tool format); nor is a property ``additionalItems`` a keyword."""
    schema = {"type": "object", "properties": {
        "format": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "prefixItems": {"type": "string"}, "additionalItems": {"type": "integer"},
        "when": {"type": "string", "format": "date"}}}  # fmt: skip
    fixed = fix_schema(schema)
    props = fixed["properties"]
    assert props["format"] == schema["properties"]["format"]
    assert props["additionalItems"] == {"type": "integer"} and "items" not in props
    assert "pattern" in props["when"]  # the rewrites still reach the property schemas
    backend.compile(StructuredOutputSpec.json_schema(schema))


def test_pydantic_uuid_versions_and_any_ip_are_what_pydantic_takes(backend, smollm2_tokenizer):
    """pydantic's own formats (a UUID4 field is ``format: uuid4``, IPvAnyAddress
    ``ipvanyaddress``) were dropped as unknown annotations: any string came back as a 200 its
    parse refused ('SmartWayPart-A-Rep'). Every string the uuid patterns take parses with
    pydantic (random hex, versions and variants); the grammar takes what pydantic does."""
    import random
    import re

    from pydantic import UUID1, UUID4, UUID7, BaseModel, IPvAnyAddress, TypeAdapter

    from tinyserve.structured.schema_fixes import UUID_PATTERNS

    rng = random.Random(0)
    for name, kind in (("uuid1", UUID1), ("uuid4", UUID4), ("uuid7", UUID7)):
        rx, parse, taken = re.compile(UUID_PATTERNS[name]), TypeAdapter(kind).validate_python, 0
        for _ in range(4000):
            h = "".join(rng.choice("0123456789abcdefABCDEF") for _ in range(32))
            text = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
            if rx.match(text):
                taken += 1
                parse(text)
        assert taken > 50, (name, taken)

    class Rec(BaseModel):
        id: UUID4
        addr: IPvAnyAddress

    compiled = backend.compile(StructuredOutputSpec.json_schema(Rec.model_json_schema()))
    for text, ok in (
        ('{"id": "123e4567-e89b-42d3-a456-426614174000", "addr": "10.0.0.1"}', True),
        ('{"id": "123e4567-e89b-42d3-a456-426614174000", "addr": "::1"}', True),
        ('{"id": "123e4567-e89b-12d3-a456-426614174000", "addr": "10.0.0.1"}', False),  # v1
        ('{"id": "SmartWayPart-A-Rep", "addr": "10.0.0.1"}', False),
        ('{"id": "123e4567-e89b-42d3-a456-426614174000", "addr": "Cities of A&P"}', False),
    ):
        assert _takes(backend, compiled, smollm2_tokenizer, text) == ok, text
        if ok:
            Rec.model_validate_json(text)
