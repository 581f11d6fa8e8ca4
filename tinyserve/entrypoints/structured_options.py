"""vLLM's ``structured_outputs`` body field as a grammar, with vLLM's options for JSON.

The options (``protocol.StructuredOutputsField``; ``guided_whitespace_pattern`` is an alias
of the second):

* ``disable_any_whitespace``: JSON with no whitespace between tokens (``{"a":1,"b":[2]}``);
* ``whitespace_pattern``: the regex JSON's whitespace between tokens must match, with ``,``
  and ``:`` as separators (what vLLM's grammar libraries do with it);
* ``disable_additional_properties``: objects take their declared properties only
  (``structured/strict.py``, as ``response_format`` with ``strict`` does);
* ``disable_fallback``: accepted; one grammar library serves here, there is nothing to
  fall back from.

They shape a JSON answer: ``json``, ``json_object`` and a ``response_format`` JSON schema
given beside options-only ``structured_outputs``. A regex, choice or grammar defines its
own whitespace, so there they change nothing. The layout goes into the schema's top-level
``x-guidance`` (llguidance's options, over the server's default layout in
``structured/backend.py``); a schema's own ``x-guidance`` keys win over them.
``structural_tag`` is a 400.
"""

from __future__ import annotations

import dataclasses
import json

from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints.protocol import bad_request
from tinyserve.sampling_params import StructuredOutputsParams
from tinyserve.structured.schema_approx import PRETTY_WHITESPACE
from tinyserve.structured.schema_fixes import fix_schema
from tinyserve.structured.strict import closed_objects
from tinyserve.utils.regex_size import check_regex

_MODES = ("json_", "regex", "choice", "grammar", "json_object")
_NO_WHITESPACE = {"whitespace_flexible": False, "whitespace_pattern": None,
                  "item_separator": ",", "key_separator": ":"}  # fmt: skip
# The server's --json-pretty layout: ',' and ':' with, in each gap, at most one space or one
# newline and up to 40 spaces (json.dumps's one-line and indent=2 forms both pass).
PRETTY = {**_NO_WHITESPACE, "whitespace_flexible": True, "whitespace_pattern": PRETTY_WHITESPACE}


def structured_outputs_field(so: P.StructuredOutputsField | None) -> StructuredOutputsParams | None:
    """The field's constraint; None without one (absent, or options only: those then shape
    a ``response_format``, see ``with_json_options``)."""
    if so is None:
        return None
    if so.structural_tag is not None:
        raise bad_request(
            "structured_outputs.structural_tag: not supported (use tools, or a grammar)",
            "structured_outputs.structural_tag",
        )
    if all(getattr(so, m) is None for m in _MODES) and _has_options(so):
        return None
    try:
        return StructuredOutputsParams(
            json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
            json_object=so.json_object,
        )  # fmt: skip
    except ValueError as e:
        raise bad_request(e, "structured_outputs") from None


def _has_options(so: P.StructuredOutputsField) -> bool:
    """Some option sent, its default value too (a client that writes every field: a 400
    "give exactly one of json, ..." beside a response_format before)."""
    options = {"disable_any_whitespace", "whitespace_pattern", "disable_additional_properties",
               "disable_fallback"}  # fmt: skip
    return bool(options & so.model_fields_set)


def _layout(so: P.StructuredOutputsField) -> dict | None:
    if so.whitespace_pattern is not None and so.disable_any_whitespace:
        raise bad_request(
            "structured_outputs: give whitespace_pattern or disable_any_whitespace, not both",
            "structured_outputs.whitespace_pattern",
        )
    if so.disable_any_whitespace:
        return dict(_NO_WHITESPACE)
    if so.whitespace_pattern is None:
        return None
    field = "structured_outputs.whitespace_pattern"
    if not so.whitespace_pattern:
        raise bad_request(f"{field}: must be a non-empty regex", field)
    try:
        check_regex(so.whitespace_pattern, field)
    except ValueError as e:
        raise bad_request(e, field) from None
    return {**_NO_WHITESPACE, "whitespace_flexible": True,
            "whitespace_pattern": so.whitespace_pattern}  # fmt: skip


def with_json_options(
    params: StructuredOutputsParams | None,
    so: P.StructuredOutputsField | None,
    default_layout: dict | None = None,
) -> StructuredOutputsParams | None:
    """``params`` with the field's JSON options applied where it asks for JSON; without a
    layout of the request's own, ``default_layout`` (the server's --json-pretty)."""
    if params is None or (params.json is None and not params.json_object):
        return params
    layout = _layout(so) if so is not None else None
    layout, close = layout or default_layout, so is not None and so.disable_additional_properties
    if layout is None and not close:
        return params
    schema = {"type": "object"} if params.json_object else params.json
    if isinstance(schema, str):
        schema = json.loads(schema)  # valid JSON: the params checked it
    if not isinstance(schema, dict):  # a boolean schema: no object to shape or close
        return params
    if close:
        schema = closed_objects(schema)
    if layout is not None:
        own = schema.get("x-guidance")
        schema = {**schema, "x-guidance": {**layout, **(own if isinstance(own, dict) else {})}}
    try:
        return dataclasses.replace(params, json=schema, json_object=None)
    except ValueError as e:
        raise bad_request(e, params.field) from None


def json_answer_schema(fmt: StructuredOutputsParams | None) -> dict | None:
    """The JSON schema a response format asks of an answer beside tools (``json_object``:
    any object); None without one. Regex, choice or grammar formats come only through
    ``structured_outputs``, which tools do not take. A schema the rewrites refuse
    (schema_fixes.py) is a 400 naming the format: a template's own call grammar builds it
    in, and its errors named ``tools``."""
    if fmt is None:
        return None
    if fmt.json_object:
        return {"type": "object"}
    schema = json.loads(fmt.json) if isinstance(fmt.json, str) else fmt.json
    try:
        fix_schema(schema)
    except ValueError as e:
        raise bad_request(f"{fmt.field}: invalid JSON schema: {e}", fmt.field) from None
    return schema
