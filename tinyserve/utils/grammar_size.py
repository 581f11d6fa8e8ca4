"""How big a structured-output spec is before the grammar library sees it: a Lark / GBNF
grammar, a regex or a JSON schema longer than ``MAX_SPEC_CHARS``, or a schema nested deeper
than ``MAX_SCHEMA_DEPTH``, is a 400 naming the field and the limit when the request arrives.

The grammar library compiles by recursion (structured/sandbox.py): the size of what it is
given bounds how deep it goes. A 256,000-character grammar holds at most ~13,000 chained
rules, which compile in 40 MB of stack; the compile sandbox's child has 64 MiB and the
server's compile threads 256 MiB. Pure Python, no imports from the package."""

from __future__ import annotations

from typing import Any

MAX_SPEC_CHARS = 256_000
MAX_SCHEMA_DEPTH = 100  # nested objects and arrays in the schema document itself


def check_spec_text(text: str, field: str, what: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(
            f"{field}: the {what} is {len(text):,} characters; at most {MAX_SPEC_CHARS:,} "
            "are accepted"
        )


def schema_depth(schema: Any) -> int:
    """How many objects and arrays deep ``schema`` nests (iterative: any depth is safe)."""
    deepest, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_schema(schema: Any, text_len: int, field: str) -> None:
    """``text_len``: the schema's length as compact JSON."""
    if text_len > MAX_SPEC_CHARS:
        raise ValueError(
            f"{field}: the JSON schema is {text_len:,} characters as JSON; at most "
            f"{MAX_SPEC_CHARS:,} are accepted"
        )
    depth = schema_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"{field}: the JSON schema nests {depth} objects and arrays deep; at most "
            f"{MAX_SCHEMA_DEPTH} are accepted"
        )
