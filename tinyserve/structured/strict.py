"""OpenAI's strict semantics for a JSON schema: objects hold their declared properties only.
Torch-free. Applied to tool parameters by default (entrypoints/tools.py; the server's
--open-tool-arguments turns it off) and to a ``response_format`` with ``strict: true``."""

from __future__ import annotations

# Keywords whose values are schemas, or maps / lists of schemas.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed_objects(schema):
    """A copy of ``schema`` in which every object schema that declares ``properties`` and
    says nothing of others gets ``"additionalProperties": false``: a call's arguments hold
    the declared properties only (OpenAI's strict mode). A schema that allows others
    (``additionalProperties`` or ``patternProperties`` given) is left as it says."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out
