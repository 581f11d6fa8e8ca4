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
  ``propertyNames``, ``unevaluated*``, other forms of ``not``): the finished answer is
  validated against the schema as the client wrote it (``final_check``; the output
  processor runs it when the grammar ends the answer) and a failure ends the request with a
  400 naming the field and the keyword, never a 200.

Every schema carrying one of these keywords is checked after, narrowed or not.
"""

from __future__ import annotations

import functools
import json

# Where subschemas live (a map's values / a list's items are schemas).
_SUB = ("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
KEYWORDS = frozenset({"not", "if", "then", "else", "contains", "minContains", "maxContains",
                      "uniqueItems", "dependentRequired", "dependentSchemas", "dependencies",
                      "propertyNames", "unevaluatedProperties", "unevaluatedItems"})  # fmt: skip
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def uses_keywords(schema) -> bool:
    """True when some schema node of ``schema`` carries a keyword of ``KEYWORDS``."""
    if isinstance(schema, list):
        return any(uses_keywords(s) for s in schema)
    if not isinstance(schema, dict):
        return False
    if KEYWORDS & schema.keys():
        return True
    return any(uses_keywords(s) for s in _children(schema))


def _children(node: dict):
    for key in _SUB:
        if isinstance(node.get(key), (dict, list)):
            yield node[key]
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            yield from node[key].values()
    for key in _LISTS:
        if isinstance(node.get(key), list):
            yield from node[key]
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        yield from (d for d in deps.values() if isinstance(d, dict))


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
    return out


def approximate(schema):
    """A copy of ``schema`` with the keywords above narrowed or dropped (the input is kept)."""
    if isinstance(schema, list):
        return [approximate(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, approximate)
    if KEYWORDS & out.keys():
        _conditional(out)
        _dependencies(out)
        _negation(out)
        _contains(out)
        for key in ("uniqueItems", "propertyNames", "unevaluatedProperties", "unevaluatedItems"):
            out.pop(key, None)  # checked after
    return out


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


@functools.lru_cache(maxsize=1024)
def needs_final_check(schema_text: str) -> bool:
    """``uses_keywords`` of a schema given as JSON text (cached: asked once per answer)."""
    try:
        return uses_keywords(json.loads(schema_text))
    except ValueError:
        return False


@functools.lru_cache(maxsize=128)
def _validator(schema_text: str):
    import jsonschema

    schema = json.loads(schema_text)
    return jsonschema.validators.validator_for(schema)(schema)


def final_check(schema_text: str, answer: str) -> str | None:
    """None when ``answer`` is valid JSON that satisfies the schema, else why not (one line).
    Called only for schemas that ``uses_keywords``: the grammar enforced everything else."""
    try:
        value = json.loads(answer)
    except ValueError as e:
        return f"the answer is not JSON ({e})"
    error = next(iter(_validator(schema_text).iter_errors(value)), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "the top level"
    keyword = next((k for k in error.schema_path if k in KEYWORDS), error.validator)
    return (f"the answer breaks the schema's {keyword!r} at {where}, which the grammar "
            f"cannot enforce and was checked after generation: {error.message[:200]}")  # fmt: skip
