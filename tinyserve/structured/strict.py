"""OpenAI's strict semantics for a JSON schema: objects hold their declared properties only.
Torch-free. Applied to tool parameters by default (entrypoints/tools.py; the server's
--open-tool-arguments turns it off) and to a ``response_format`` with ``strict: true``."""

from __future__ import annotations

from tinyserve.structured.schema_approx import map_subschemas


def closed_objects(schema):
    """A copy of ``schema`` in which every object schema that declares ``properties`` and
    says nothing of others gets ``"additionalProperties": false``: a call's arguments hold
    the declared properties only (OpenAI's strict mode). A schema that allows others
    (``additionalProperties`` or ``patternProperties`` given) is left as it says."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, closed_objects)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out
