"""The request and response base models of every API's wire format (protocol.py,
protocol_responses.py, protocol_anthropic.py): lone surrogates refused, null read as the
default."""

from __future__ import annotations

import functools
import re
import types
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, field_validator, model_validator


def _check_unicode(value: Any) -> None:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which Python decodes into a str that
    cannot be encoded back to UTF-8: the tokenizer and the response encoder would fail on it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("contains a lone UTF-16 surrogate: send valid Unicode") from None
    elif isinstance(value, list):
        for v in value:
            if isinstance(v, (str, list, dict)):
                _check_unicode(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k)
            _check_unicode(v)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
    null_is_default: ClassVar[bool] = True

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit null for a field with a default is that default, as OpenAI's API
        reads it (its SDK types say ``bool | None`` for ``stream``, ``parallel_tool_calls``,
        ``echo``, ...): ``"stream": null`` was a 400 "Input should be a valid boolean"."""
        if not cls.null_is_default or not isinstance(data, dict) or None not in data.values():
            return data
        keys = _defaulted(cls)
        return {k: v for k, v in data.items() if v is not None or k not in keys}

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_unicode(value)
        return value


@functools.cache
def _defaulted(cls: type[BaseModel]) -> frozenset[str]:
    """The names (and aliases) of ``cls``'s fields whose default is not None and whose type
    does not take None: where it does, null is a value of its own (completions'
    ``max_tokens: null`` is all the room left in the context, not the default 16)."""
    keys = set()
    for name, f in cls.model_fields.items():
        if f.is_required() or _takes_none(f.annotation):
            continue
        if f.default_factory is not None or f.default is not None:
            keys.update({name, f.alias or name})
    return frozenset(keys)


def _takes_none(annotation) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and any(
        _takes_none(a) for a in typing.get_args(annotation)
    )


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# Names pydantic puts in an error's location for a union's branch, not a field: plain
# types, and the forms of ``list[int]``, ``literal['a','b']``, ``function-after[...]``.
_BRANCHES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
_BRANCH_FORM = re.compile(r"[a-z][a-z-]*\[.*\]", re.S)


def _model_names() -> set[str]:
    """Our request models' class names: a union of models names its branch so (our tagged
    unions' tags are their classes' names too). Only tinyserve's: a process's other models
    (an application's ``class User(BaseModel)``) must not hide a dict key ``User``."""
    names, seen, todo = set(), set(), [BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                if sub.__module__.startswith("tinyserve."):
                    names.add(sub.__name__)
    return names


def error_location(loc) -> str:
    """A pydantic error location as OpenAI writes a param: ``messages[0].content``; a
    union's branch names (``str``, ``list[int]``, ``function-after[...]``, a model's class
    name) left out — not a dict's keys (``metadata.User``, ``metadata.user-id``)."""
    out, models = "", None
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
            continue
        x = str(x)
        if x in _BRANCHES or _BRANCH_FORM.fullmatch(x):
            continue
        if x[:1].isupper() and x in (models := models or _model_names()):
            continue
        out += f".{x}" if out else x
    return out


def error_messages(errors, skip: tuple = ()) -> list[tuple[str, str]]:
    """``(location, message)`` per pydantic error (locations through ``error_location``,
    ``skip``'s elements left out). Where a value failed a union, each branch reports: only
    the deepest errors stay (``messages[0].content[0].type: Field required``, not also
    ``messages[0].content: Input should be a valid string``)."""
    found = [(error_location([x for x in e.get("loc", ()) if x not in skip]), str(e.get("msg")))
             for e in errors]  # fmt: skip
    deeper = [w for w, _ in found]
    kept = [(w, m) for w, m in found
            if not any(d != w and d.startswith(w) and d[len(w):][:1] in ".[" for d in deeper)]  # fmt: skip
    return list(dict.fromkeys(kept))
