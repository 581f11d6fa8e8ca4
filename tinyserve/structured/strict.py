"""OpenAI's strict semantics for a JSON schema: objects hold their declared properties only.
Torch-free. Applied to tool parameters by default (entrypoints/tools.py; the server's
--open-tool-arguments turns it off) and to a ``response_format`` unless it says ``strict:
false`` (vLLM's grammar library and llama.cpp's converter close objects the same way). Also
``dangling_ref``: a tool schema's refs checked before the envelope relocates them."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from tinyserve.structured.schema_approx import map_subschemas
from tinyserve.structured.schema_fixes import DATA_KEYS

# Keywords whose subschemas add up with their node's own: closing one of them (or the node)
# would refuse the properties the other declares.
_PARTS = ("allOf", "anyOf", "oneOf")
_ALWAYS_PARTS = ("allOf", "if", "then", "else", "dependentSchemas")


def closed_objects(schema):
    """A copy of ``schema`` in which every object schema that declares ``properties`` and
    says nothing of others gets ``"additionalProperties": false``: a call's arguments hold
    the declared properties only (OpenAI's strict mode). Left as they say: a schema that
    allows others (``additionalProperties`` or ``patternProperties`` given), and wherever
    properties add up across schemas: a node with ``allOf``, a conditional, a ``$ref`` or a
    union beside properties of its own, the parts of those, and the definitions such parts
    refer to. Closing only narrows: every answer is still valid against the schema."""
    if not isinstance(schema, dict):
        return _close(schema)
    out = _close(schema)
    for ref in sorted(set(_part_refs(schema))):
        _restore(out, schema, ref)
    return out


def _restore(out: dict, schema: dict, ref: str) -> None:
    """Put back, as written, the node that the local ``ref`` ("#/$defs/a/b") points to."""
    if not ref.startswith("#/"):
        return
    keys = pointer_keys(ref)
    src, dst = schema, out
    for key in keys[:-1]:
        if not isinstance(src, dict) or not isinstance(dst, dict) or key not in src:
            return
        src, dst = src[key], dst.get(key)
    if isinstance(src, dict) and isinstance(dst, dict) and keys[-1] in src:
        dst[keys[-1]] = src[keys[-1]]


def _composed(node: dict) -> bool:
    """Properties of ``node`` add up with another schema's."""
    if any(k in node for k in _ALWAYS_PARTS) or ("$ref" in node and "properties" in node):
        return True
    own = "properties" in node or "$ref" in node
    return own and any(k in node for k in _PARTS)


def _close(schema, part: bool = False):
    if part:  # a part is intersected with its node at every depth: left as written
        return schema
    if isinstance(schema, list):
        return [_close(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, _close)
    if _composed(schema):
        for key in (*_PARTS, *_ALWAYS_PARTS, "not"):
            if key in schema:
                out[key] = schema[key]
    open_ = "additionalProperties" in out or "patternProperties" in out or _composed(schema)
    if "properties" in out and not open_:
        out["additionalProperties"] = False
        props = out["properties"]
        missing = [r for r in out.get("required", ()) if isinstance(r, str) and r not in props]
        if isinstance(props, dict) and missing:  # required but never declared: any value
            out["properties"] = {**props, **dict.fromkeys(missing, {})}
    return out


def _refs(node):
    if isinstance(node, list):
        for item in node:
            yield from _refs(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            elif isinstance(value, (dict, list)):
                yield from _refs(value)


def _part_refs(node):
    """Every ``$ref`` inside a part of a composed node in ``node``, however deep."""
    if isinstance(node, list):
        for item in node:
            yield from _part_refs(item)
    elif isinstance(node, dict):
        if _composed(node):
            if isinstance(node.get("$ref"), str):
                yield node["$ref"]
            for key in (*_PARTS, *_ALWAYS_PARTS, "not"):
                if key in node:
                    yield from _refs(node[key])
        for value in node.values():
            if isinstance(value, (dict, list)):
                yield from _part_refs(value)


def dangling_ref(node: Any, root: Any) -> str | None:
    """The first ``$ref`` pointer (``#/...``; not an ``#anchor``) in ``node`` missing in
    ``root``; data (``const``, ``enum``, ...) and ``x-`` extensions are no schemas."""
    if isinstance(node, list):
        return next((r for v in node if (r := dangling_ref(v, root)) is not None), None)
    if not isinstance(node, dict):
        return None
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        target = root
        for part in pointer_keys(ref):
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            elif isinstance(target, dict) and part in target:
                target = target[part]
            else:
                return ref
    return next((r for k, v in node.items() if k not in DATA_KEYS and not k.startswith("x-")
                 and (r := dangling_ref(v, root)) is not None), None)  # fmt: skip


def pointer_keys(ref: str) -> list[str]:
    """The keys of a local JSON pointer ``#/a~1b/%25`` (["a/b", "%"]); ``#``: none."""
    if not ref.startswith("#/"):
        return []
    return [unquote(k).replace("~1", "/").replace("~0", "~") for k in ref[2:].split("/")]
