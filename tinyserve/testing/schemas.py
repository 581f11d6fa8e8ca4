"""Seeded random JSON schemas, regexes and choice lists for fuzzing constrained decoding
(:mod:`tinyserve.testing.structured_fuzz` drives them through the engine).

:func:`random_schema` covers what the grammar library (llguidance) implements: objects with
required / optional properties and ``additionalProperties`` false / true / absent, arrays
with ``minItems`` / ``maxItems`` and ``prefixItems``, enums (strings, numbers, mixed),
``const``, strings with ``minLength`` / ``maxLength`` / ``pattern`` / ``format`` (date, time,
uuid, email, ipv4), integers and numbers with inclusive and exclusive bounds, booleans,
null, type lists, ``anyOf`` / ``oneOf`` of disjoint types, ``allOf`` of compatible parts,
``$defs`` + ``$ref`` (plain, and recursive with a base case), nested to ``depth``. Sizes are
bounded so a completed output is usually ~150 tokens or fewer. With ``unsupported`` > 0 a
schema sometimes carries a keyword llguidance refuses (``UNSUPPORTED``): the engine must
refuse it with a ValueError naming the keyword.

Every pattern and regex here means the same to Python's ``re`` and Rust's ``regex`` (ASCII
classes, bounded repeats), so ``re`` can check what the grammar produced.
"""

from __future__ import annotations

import random
import string

# Patterns for ``pattern``: anchored and not (JSON schema patterns are unanchored).
PATTERNS = (
    "^[a-z]{1,6}$",
    "^[A-Z][a-z]{0,5}$",
    "^[0-9]{2,4}-[0-9]{2}$",
    "^(red|green|blue)$",
    "^[a-f0-9]{4}$",
    "^x[0-9]?y$",
    "^[a-z]{1,4}( [a-z]{1,4})?$",
    "^\\+?[0-9]{3}$",
    "^[A-Z]{2}[0-9]{1,3}$",
    "^[a-z_]{1,5}\\.[a-z]{2,3}$",
    "[0-9]{3}",
    "ab",
)
FORMATS = ("date", "time", "uuid", "email", "ipv4")
# Keywords llguidance refuses and structured/schema_approx.py does not narrow or check after.
UNSUPPORTED = (
    ("$dynamicRef", "#meta"),
    ("$recursiveRef", "#"),
)
_WORDS = ("a", "ab", "abc", "yes", "no", "N/A", "x y", "ünï", "日本", 'q"t', "b\\s", "", "tab\t")
_NUMBERS = (0, 1, -1, 2, 7, 42, -13, 0.5, 2.25, -0.125, 1e3, 100)
_LEAF_KINDS = ("string", "integer", "number", "boolean", "null", "enum", "const", "typelist")
_DISJOINT = ("string", "integer", "boolean", "null", "object", "array")


# -- leaves -------------------------------------------------------------------------------------


def _string(rng: random.Random) -> dict:
    pick = rng.random()
    if pick < 0.25:
        return {"type": "string", "pattern": rng.choice(PATTERNS), "maxLength": 16}
    if pick < 0.4:
        return {"type": "string", "format": rng.choice(FORMATS)}
    lo = rng.choice((0, 0, 1, 2, 3))
    out = {"type": "string", "maxLength": lo + rng.randint(0, 10)}
    if lo:
        out["minLength"] = lo
    return out


def _integer(rng: random.Random) -> dict:
    lo = rng.randint(-50, 50)
    hi = lo + rng.choice((0, 1, 2, 5, 10, 100, 1000))
    out: dict = {"type": "integer"}
    if rng.random() < 0.8:
        out["exclusiveMinimum" if rng.random() < 0.3 else "minimum"] = lo
    if rng.random() < 0.8 or len(out) == 1:
        out["exclusiveMaximum" if rng.random() < 0.3 else "maximum"] = hi + 1
    return out


def _number(rng: random.Random) -> dict:
    lo = round(rng.uniform(-100, 100), rng.choice((0, 1, 2)))
    hi = round(lo + rng.choice((0.5, 1, 2.5, 10, 1000)), 2)
    out: dict = {"type": "number"}
    if rng.random() < 0.8:
        out["exclusiveMinimum" if rng.random() < 0.4 else "minimum"] = lo
    if rng.random() < 0.8:
        out["exclusiveMaximum" if rng.random() < 0.4 else "maximum"] = hi
    return out


def _enum(rng: random.Random) -> dict:
    flavour = rng.choice(("strings", "numbers", "mixed"))
    pool: list = {
        "strings": list(_WORDS),
        "numbers": list(_NUMBERS),
        "mixed": [*_WORDS[:6], *_NUMBERS[:6], True, False, None],
    }[flavour]
    values = rng.sample(pool, rng.randint(1, min(5, len(pool))))
    # 1 and 1.0 (and True) are one value to jsonschema's ``enum`` uniqueness: keep the first.
    seen, unique = set(), []
    for v in values:
        key = (type(v) is bool, v)
        if key not in seen:
            seen.add(key)
            unique.append(v)
    return {"enum": unique}


def _const(rng: random.Random) -> dict:
    return {"const": rng.choice((*_WORDS[:5], *_NUMBERS[:4], True, None, [1, "a"], {"k": 1}))}


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(_LEAF_KINDS)
    if kind == "string":
        return _string(rng)
    if kind == "integer":
        return _integer(rng)
    if kind == "number":
        return _number(rng)
    if kind == "enum":
        return _enum(rng)
    if kind == "const":
        return _const(rng)
    if kind == "typelist":
        return {"type": ["integer", "null"], "minimum": 0, "maximum": 99}
    return {"type": kind}


# -- containers ---------------------------------------------------------------------------------


class _Gen:
    """One schema's generator: the rng, and the $defs a $ref may point at."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.defs: dict[str, dict] = {}

    def any(self, depth: int) -> dict:
        rng = self.rng
        if depth <= 0:
            return _leaf(rng)
        pick = rng.random()
        if pick < 0.3:
            return self.object(depth - 1)
        if pick < 0.45:
            return self.array(depth - 1)
        if pick < 0.55:
            return self.union(depth - 1)
        if pick < 0.6 and self.defs:
            return {"$ref": f"#/$defs/{rng.choice(sorted(self.defs))}"}
        if pick < 0.63:
            return self.all_of()
        return _leaf(rng)

    def object(self, depth: int) -> dict:
        rng = self.rng
        names = rng.sample(
            ("id", "name", "kind", "value", "tags", "meta", "x", "é", "a b"), rng.randint(1, 4)
        )
        props = {name: self.any(depth) for name in names}
        out: dict = {"type": "object", "properties": props}
        required = [n for n in names if rng.random() < 0.6]
        if required:
            out["required"] = required
        extra = rng.random()
        if extra < 0.7:
            out["additionalProperties"] = False
        elif extra < 0.8:
            out["additionalProperties"] = True
        elif extra < 0.9:
            out["additionalProperties"] = {"type": "integer", "minimum": 0, "maximum": 9}
        return out

    def array(self, depth: int) -> dict:
        rng = self.rng
        lo = rng.choice((0, 0, 1, 2))
        out: dict = {"type": "array", "items": self.any(depth)}
        if lo:
            out["minItems"] = lo
        out["maxItems"] = lo + rng.randint(0, 3)
        if rng.random() < 0.15:
            out["prefixItems"] = [_leaf(rng) for _ in range(rng.randint(1, 2))]
            out["maxItems"] = max(out["maxItems"], len(out["prefixItems"]))
            out["minItems"] = min(lo, len(out["prefixItems"]))
        return out

    def union(self, depth: int) -> dict:
        """anyOf / oneOf over disjoint types, so oneOf (compiled as anyOf) is exact."""
        rng = self.rng
        types = rng.sample(_DISJOINT, rng.randint(2, 3))
        branches = []
        for t in types:
            if t == "object":
                branches.append(self.object(max(depth - 1, 0)))
            elif t == "array":
                branches.append(self.array(max(depth - 1, 0)))
            elif t == "string":
                branches.append(_string(rng))
            elif t == "integer":
                branches.append(_integer(rng))
            else:
                branches.append({"type": t})
        return {rng.choice(("anyOf", "oneOf")): branches}

    def all_of(self) -> dict:
        """allOf of parts that agree: an object's properties and its required list apart."""
        rng = self.rng
        props = {"a": _integer(rng), "b": _string(rng)}
        return {
            "allOf": [
                {"type": "object", "properties": props, "additionalProperties": False},
                {"required": rng.sample(sorted(props), rng.randint(1, 2))},
            ]
        }

    def add_defs(self, depth: int) -> None:
        rng = self.rng
        self.defs["leaf"] = _leaf(rng)
        if rng.random() < 0.5:
            self.defs["thing"] = self.object(max(depth - 2, 0))
        if rng.random() < 0.5:
            self.defs["node"] = _recursive_node(rng)


def _recursive_node(rng: random.Random) -> dict:
    """A recursive $def with a base case: children may be empty, or next may be null."""
    value = _leaf(rng)
    if rng.random() < 0.5:
        children = {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}
        return {"type": "object", "properties": {"value": value, "children": children},
                "required": ["value"], "additionalProperties": False}  # fmt: skip
    nxt = {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}
    return {"type": "object", "properties": {"value": value, "next": nxt},
            "required": ["value", "next"], "additionalProperties": False}  # fmt: skip


def random_schema(rng: random.Random, depth: int = 3, unsupported: float = 0.0) -> dict:
    """One random JSON schema (draft 2020-12), nested at most ``depth`` containers deep.
    With probability ``unsupported`` it also carries one keyword from UNSUPPORTED."""
    gen = _Gen(rng)
    use_defs = rng.random() < 0.25
    if use_defs:
        gen.add_defs(depth)
    pick = rng.random()
    if use_defs and "node" in gen.defs and pick < 0.3:
        schema: dict = {"$ref": "#/$defs/node"}
    elif pick < 0.7:
        schema = gen.object(depth - 1)
    elif pick < 0.85:
        schema = gen.array(depth - 1)
    else:
        schema = gen.any(depth)
    if use_defs:
        schema = {"$defs": gen.defs, **schema}
    if rng.random() < unsupported:
        key, value = rng.choice(UNSUPPORTED)
        schema = {**schema, key: value}
    return schema


def unsupported_keyword(schema: dict) -> str | None:
    """The UNSUPPORTED keyword random_schema put at the top of ``schema``, if any."""
    return next((k for k, _ in UNSUPPORTED if k in schema), None)


# -- regexes and choices ------------------------------------------------------------------------

_REGEX_ATOMS = (
    lambda r: f"[a-z]{{{r.randint(0, 2)},{r.randint(2, 5)}}}",
    lambda r: f"[0-9]{{{r.randint(1, 4)}}}",
    lambda r: f"[A-Z]{{1,{r.randint(1, 3)}}}",
    lambda r: r.choice(("-", "_", ":", "\\.", " ", "/", "@", "\\+")),
    lambda r: (
        "(" + "|".join(r.sample(("cat", "dog", "ox", "a", "ab", "über"), r.randint(2, 3))) + ")"
    ),
    lambda r: r.choice(("x", "yz", "ID", "v")) + "?",
    lambda r: f"[a-f0-9]{{{r.randint(2, 8)}}}",
    lambda r: "(ab|cd){1,3}",
)


def random_regex(rng: random.Random) -> str:
    """A regex of 1-5 bounded atoms (classes, literals, alternations, optionals)."""
    return "".join(rng.choice(_REGEX_ATOMS)(rng) for _ in range(rng.randint(1, 5)))


def random_choices(rng: random.Random) -> list[str]:
    """1-6 distinct non-empty strings: prefixes of each other, unicode, quotes, spaces."""
    pool = [w for w in _WORDS if w] + ["a b c", "{json}", "100%", "\\n", "🙂", "ab "]
    picked = rng.sample(pool, rng.randint(1, 6))
    if rng.random() < 0.3:
        picked.append(
            "".join(rng.choices(string.ascii_letters + string.digits, k=rng.randint(1, 12)))
        )
    return list(dict.fromkeys(picked))


def rule_chain(n: int) -> str:
    """A Lark grammar of ``n`` chained rules (``r0: r1 "x"``, ``r1: r2 "x"``, ...): the grammar
    library compiles it by recursion, one level a rule (issue 37's crash: 3,000 of them
    overflowed an 8 MiB thread stack)."""
    rules = [f'r{i}: r{i + 1} "x"' for i in range(n)] + [f'r{n}: "a"']
    return "start: r0\n" + "\n".join(rules)


def ref_chain(n: int) -> dict:
    """A JSON schema whose ``n`` ``$defs`` each hold a ``$ref`` to the next (1,000 of them
    overflowed an 8 MiB thread stack in the grammar library)."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}
