"""JSON-schema keywords the grammar library does not implement, narrowed or checked after.
Torch-free.

llguidance (1.9.1) refuses ``not``, ``if``/``then``/``else``, ``contains`` (and
``minContains`` / ``maxContains``), ``uniqueItems``, ``dependentRequired``,
``dependentSchemas``, ``dependencies``, ``propertyNames`` and ``unevaluatedProperties`` /
``unevaluatedItems``: a grammar cannot count or compare what it has already written. Real
schemas use them (SchemaStore, Kubernetes, GitHub: issue 39). Each is handled in one of two
ways, and neither can let an invalid answer through:

* **Narrowed** to a schema the library does take, whose every instance satisfies the
  keyword (the answer may lose freedom, never validity):
  ``if``/``then`` -> ``then`` always; ``if``/``then``/``else`` -> ``allOf: [if, then]`` (an
  instance that satisfies ``if`` and ``then`` satisfies the conditional; ``if: false`` ->
  ``else``);
  ``contains`` -> the first ``minContains`` (default 1) items are ``allOf: [items, contains]``;
  ``not: {required: [...]}`` (alone or as ``anyOf`` of them) -> a listed property the object
  does not require is forbidden (``properties: {k: false}``); ``not: {type: ...}`` -> the
  other types; ``dependentRequired`` / ``dependencies`` / ``dependentSchemas`` on a property
  -> the dependency is added when the property is required, else the property is forbidden.
* **Dropped from the grammar and checked after** (``uniqueItems``, ``maxContains``,
  ``propertyNames``, ``unevaluated*``, other forms of ``not``, ``maxProperties`` and
  ``minProperties`` where not every declared property is required and the library refuses
  them, a ``pattern`` with look-around): the finished answer is
  validated against the schema as the client wrote it (``final_check``; the output
  processor runs it when the grammar ends the answer) and a failure ends the request with a
  400 naming the field and the keyword, never a 200.

Every schema carrying one of these keywords is checked after, narrowed or not; so is every
schema with a ``oneOf``, which the library compiles as ``anyOf`` (exact where the branches
are disjoint; an answer valid under two branches is not valid under ``oneOf``).
"""

from __future__ import annotations

import functools
import json

from tinyserve.structured.answer_validator import answer_validator

# Where subschemas live (a map's values / a list's items are schemas).
_SUB = ("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
KEYWORDS = frozenset({"not", "if", "then", "else", "contains", "minContains", "maxContains",
                      "uniqueItems", "dependentRequired", "dependentSchemas", "dependencies",
                      "propertyNames", "unevaluatedProperties", "unevaluatedItems",
                      "minProperties", "maxProperties"})  # fmt: skip
# Keys whose values are data or walked above: never read as a schema by the walk below.
_DATA = frozenset({"const", "enum", "default", "examples", "x-guidance", "dependentRequired"})
_KNOWN = _DATA | frozenset(_SUB) | frozenset(_MAPS) | frozenset(_LISTS) | {"dependencies"}
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def uses_keywords(schema) -> bool:
    """True when some schema node of ``schema`` carries a keyword of ``KEYWORDS``, a
    ``oneOf`` or a look-around pattern: an answer the grammar ends must still be checked."""
    if isinstance(schema, list):
        return any(uses_keywords(s) for s in schema)
    if not isinstance(schema, dict):
        return False
    if KEYWORDS & schema.keys() or "oneOf" in schema or _lookaround(schema) or _huge(schema):
        return True  # (oneOf is compiled as anyOf: wider where its branches overlap)
    return any(uses_keywords(s) for s in _children(schema))


def _huge(schema: dict) -> bool:
    """A number bound past 2^53, which the library reads as a float (or an i64): ``minimum:
    2^53 + 1`` let 2^53 through, ``minimum: 2^64 - 6`` 2^63 - 1."""
    bounds = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
    return any(type(v) in (int, float) and abs(v) > 2**53 for v in map(schema.get, bounds))


_LOOKAROUNDS = ("(?=", "(?!", "(?<=", "(?<!")


def _looks_around(pattern) -> bool:
    return isinstance(pattern, str) and any(a in pattern for a in _LOOKAROUNDS)


def strip_lookaround(pattern: str) -> str:
    """``pattern`` without its look-around groups: it matches everything ``pattern`` does."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\":
            out.append(pattern[i : i + 2])
            i += 2
        elif pattern[i] == "[":  # a class: copied whole ("(" inside is a character)
            j = _class_end(pattern, i)
            out.append(pattern[i:j])
            i = j
        elif pattern.startswith(_LOOKAROUNDS, i):
            i = _group_end(pattern, i)
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class that opens at ``pattern[i]``."""
    j = i + 1 + (pattern[i + 1 : i + 2] == "]")
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def _group_end(pattern: str, i: int) -> int:
    """The index after the group that opens at ``pattern[i]``."""
    depth = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "[":
            i = _class_end(pattern, i)
            continue
        if c == "\\":
            i += 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def _lookaround(node: dict) -> bool:
    """A ``pattern`` (or a ``patternProperties`` key) with look-around, which the library's
    regex engine has not."""
    keyed = node.get("patternProperties")
    return _looks_around(node.get("pattern")) or (
        isinstance(keyed, dict) and any(_looks_around(k) for k in keyed)
    )


def _children(node: dict) -> list:
    """The direct subschemas of ``node`` (those ``map_subschemas`` maps)."""
    found: list = []
    map_subschemas(node, lambda sub: found.append(sub) or sub)
    return found


def map_subschemas(node: dict, fn) -> dict:
    """A copy of the schema ``node`` with ``fn`` applied to each of its direct subschemas."""
    out = dict(node)
    for key in _SUB:
        if isinstance(out.get(key), (dict, list)):
            out[key] = fn(out[key])
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: fn(v) for k, v in out[key].items()}
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [fn(s) for s in out[key]]
    if isinstance(out.get("dependencies"), dict):
        out["dependencies"] = {k: fn(v) for k, v in out["dependencies"].items()}
    for key, value in out.items():  # a "$ref" may point anywhere: "#/definitions/group/x"
        if isinstance(value, dict) and key not in _KNOWN:
            out[key] = fn(value)
    return out


def approximate(schema, narrow: bool = True):
    """A copy of ``schema`` with the keywords above narrowed or dropped (the input is kept).
    ``narrow=False`` drops them all (every one then checked after): for a schema whose
    narrowing the library cannot compile ("schema too large": an ``allOf`` of a conditional
    over ``$ref``s and unions that its intersection multiplies out)."""
    if isinstance(schema, list):
        return [approximate(s, narrow) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if narrow and isinstance(schema.get("allOf"), list):
        schema = _discriminated(schema)
    out = map_subschemas(schema, lambda s: approximate(s, narrow))
    if _lookaround(out):  # each pattern without its look-arounds: a wider one, checked after
        if _looks_around(out.get("pattern")):
            out["pattern"] = strip_lookaround(out["pattern"])
        if isinstance(out.get("patternProperties"), dict):
            keyed = out["patternProperties"].items()
            out["patternProperties"] = {strip_lookaround(k): v for k, v in keyed}
    if KEYWORDS & out.keys():
        if narrow:
            _conditional(out)
            _dependencies(out)
            _negation(out)
            _contains(out)
            _property_counts(out)
        declared = out.get("properties") or {}
        keep = set()
        if _required(out).issuperset(declared):
            keep = {"minProperties", "maxProperties"}  # the library takes these: exact
        for key in KEYWORDS - keep:
            out.pop(key, None)  # checked after
    return out


def _const_test(cond) -> tuple[str, str] | None:
    """(key, canonical value) when ``cond`` is ``{"properties": {key: {"const": v}}}`` (a
    ``required`` of that key, an ``enum`` of one value and a ``type`` allowed)."""
    if not isinstance(cond, dict) or not set(cond) <= {"properties", "required"}:
        return None
    props = cond.get("properties")
    if not isinstance(props, dict) or len(props) != 1 or cond.get("required", [*props]) != [*props]:
        return None
    ((key, test),) = props.items()
    if not isinstance(test, dict) or not set(test) <= {"const", "enum", "type"}:
        return None
    if "const" in test:
        return key, json.dumps(test["const"], sort_keys=True)
    enum = test.get("enum")
    return (
        (key, json.dumps(enum[0], sort_keys=True))
        if isinstance(enum, list) and len(enum) == 1
        else None
    )


_COND_KEYS = {"if", "then", "else", "$comment", "description", "title"}


def _discriminated(node: dict) -> dict:
    """``allOf`` parts that are conditionals on one property's value (``if type == "a" then
    A``, ``if type == "b" then B``, ...: a tagged union written as conditionals) become one
    ``anyOf`` of branches ``type == v_i and then_i and every other else``: exact for the
    instances whose tag is one of the values, which are the only ones kept. (Requiring every
    ``then`` at once, as a lone conditional is narrowed, would intersect the variants.)"""
    parts = node["allOf"]
    conds = [p for p in parts if isinstance(p, dict) and "if" in p and set(p) <= _COND_KEYS]
    tests = [_const_test(p["if"]) for p in conds]
    if len(conds) < 2 or None in tests or len({k for k, _ in tests}) != 1:
        return node
    if len({v for _, v in tests}) != len(tests):
        return node
    key = tests[0][0]
    branches = []
    for i, part in enumerate(conds):
        tag = {"properties": {key: {"const": json.loads(tests[i][1])}}, "required": [key]}
        others = [q["else"] for j, q in enumerate(conds) if j != i and "else" in q]
        branches.append({"allOf": [tag, *([part["then"]] if "then" in part else []), *others]})
    rest = [p for p in parts if not any(p is c for c in conds)]
    return {**node, "allOf": [*rest, {"anyOf": branches}]}


def _all_of(node: dict, *schemas) -> None:
    extra = [s for s in schemas if s is not True and s is not None]
    if extra:
        node["allOf"] = [*node.get("allOf", []), *extra]


def _conditional(node: dict) -> None:
    cond, then, other = node.pop("if", None), node.pop("then", None), node.pop("else", None)
    if cond is False:
        _all_of(node, other)
    elif cond is not None and other is None:
        _all_of(node, then)  # "then" always: no need to force the condition
    elif cond is not None:  # without "if", "then" and "else" have no effect
        _all_of(node, cond, then)


def _contains(node: dict) -> None:
    has = "contains" in node
    want, least = node.pop("contains", None), node.pop("minContains", 1)
    node.pop("maxContains", None)  # checked after
    if not has or not isinstance(least, int) or least <= 0:
        return
    if "prefixItems" in node or isinstance(node.get("items"), list):
        return  # positions taken by a tuple: left to the check after
    items = node.get("items", True)
    first = want if items is True else {"allOf": [items, want]}
    node["prefixItems"] = [first] * least
    node["minItems"] = max(node.get("minItems", 0), least)


def _required(node: dict) -> set:
    """The properties ``node`` requires, its ``allOf`` branches' included."""
    branches = [node, *(b for b in node.get("allOf", ()) if isinstance(b, dict))]
    return {r for b in branches for r in b.get("required", ()) if isinstance(r, str)}


def _property_counts(node: dict) -> None:
    """The library takes ``minProperties`` / ``maxProperties`` only where every declared
    property is required. Elsewhere ``minProperties: n`` requires the first declared ones
    until n are (every instance then has n keys), or is checked after if too few are
    declared; ``maxProperties`` is checked after."""
    declared = list(node.get("properties", {}))
    required = _required(node)
    if not declared or required.issuperset(declared):
        return
    least = node.pop("minProperties", 0)
    node.pop("maxProperties", None)
    if not isinstance(least, int) or least <= len(required):
        return
    extra = [p for p in declared if p not in required][: least - len(required)]
    if len(required) + len(extra) >= least:
        node["required"] = [*node.get("required", []), *extra]


def _forbid(node: dict, names) -> bool:
    """Forbid one of ``names`` that ``node`` does not require; False when all are required."""
    required = _required(node)
    for name in names:
        if isinstance(name, str) and name not in required:
            node["properties"] = {**node.get("properties", {}), name: False}
            return True
    return False


def _negation(node: dict) -> None:
    neg = node.pop("not", None)
    if not isinstance(neg, dict):
        return
    if neg.keys() == {"required"}:
        _forbid(node, neg["required"])
    elif neg.keys() == {"anyOf"} and all(
        isinstance(b, dict) and b.keys() == {"required"} for b in neg["anyOf"]
    ):
        for branch in neg["anyOf"]:
            _forbid(node, branch["required"])
    elif neg.keys() == {"type"}:
        banned = {neg["type"]} if isinstance(neg["type"], str) else set(neg["type"])
        if "number" in banned:
            banned.add("integer")  # every integer is a number
        own = node.get("type", list(_TYPES))
        own = [own] if isinstance(own, str) else list(own)
        kept = [t for t in own if t not in banned and not (t == "number" and "integer" in banned)]
        if kept:
            node["type"] = kept[0] if len(kept) == 1 else kept


def _dependencies(node: dict) -> None:
    required = _required(node)
    deps = {**node.pop("dependencies", {}), **node.pop("dependentSchemas", {}),
            **node.pop("dependentRequired", {})}  # fmt: skip
    for name, dep in deps.items():
        if name not in required:
            _forbid(node, [name])
        elif isinstance(dep, list):
            node["required"] = [*node.get("required", []), *(d for d in dep if d not in required)]
            required.update(dep)
        else:
            _all_of(node, dep)


@functools.lru_cache(maxsize=128)
def needs_final_check(schema_text: str) -> bool:
    """``uses_keywords`` of a schema given as JSON text (cached: asked once per answer), or
    grammar options of the client's own in its top-level ``x-guidance`` outside
    ``_SAFE_OPTIONS``: a whitespace pattern (vLLM's ``whitespace_pattern``), separators or
    leniency may let through text that is not JSON, or not valid, so such an answer is
    parsed and validated before it is sent."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return False
    layout = schema.get("x-guidance") if isinstance(schema, dict) else None
    if isinstance(layout, dict) and any(
        v is not None and v not in _SAFE_OPTIONS.get(k, ()) for k, v in layout.items()
    ):
        return True
    return uses_keywords(schema)


# The whitespace of `serve --json-pretty`'s layout: in each gap at most one space, or one
# newline and up to 40 spaces (as llama.cpp's json.gbnf bounds it).
PRETTY_WHITESPACE = r"[ ]?|\n[ ]{0,40}"
# llguidance's JSON options, and the values of them that keep every answer JSON (free
# whitespace is JSON's; the tools' one-line layout, disable_any_whitespace's and
# --json-pretty's use these).
_SAFE_OPTIONS = {"whitespace_flexible": (True, False), "coerce_one_of": (True, False),
                 "item_separator": (",", ", "), "key_separator": (":", ": "),
                 "whitespace_pattern": (PRETTY_WHITESPACE,)}  # fmt: skip


def final_check(schema_text: str, answer: str) -> str | None:
    """None when ``answer`` is valid JSON that satisfies the schema, else why not (one line).
    Called only for schemas that ``uses_keywords``: the grammar enforced everything else."""
    try:
        value = json.loads(answer)
    except ValueError as e:
        return f"the answer is not JSON ({e})"
    error = next(iter(answer_validator(schema_text).iter_errors(value)), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "the top level"
    keyword = next((k for k in error.schema_path if k in KEYWORDS), error.validator)
    return (f"the answer breaks the schema's {keyword!r} at {where}, which the grammar "
            f"cannot enforce and was checked after generation: {error.message[:200]}")  # fmt: skip
