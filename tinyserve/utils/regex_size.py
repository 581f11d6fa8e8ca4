"""How big a regex is before the grammar library sees it: structured outputs' patterns (a
``regex`` spec, a JSON schema's ``pattern`` / ``patternProperties``, tool parameters) are
sized when the request arrives, so a pattern that would blow up is a 400 naming its field,
never a failure mid-answer. Pure Python, no imports from the package."""

from __future__ import annotations

import re
from typing import Any

# A pattern whose counted repetitions expand past this many states is refused when the request
# arrives (a 400), before any token: llguidance compiles regexes lazily, so such a pattern
# (`(?:a{1000}){1000}`: a million states) passed validation and failed mid-answer (issue 37).
MAX_REGEX_STATES = 20_000


def regex_states(pattern: str) -> int:
    """An upper estimate of the automaton states ``pattern`` unrolls to: each literal, escape
    or character class 1, a group the sum of its items (all branches of an alternation), a
    repetition its item times its largest count (``*``, ``+``, ``{m,}``: m + 1). Syntax it
    does not know counts one per character; the library still parses the pattern."""
    stack: list[list[int]] = [[0, 0]]  # per open group: [size so far, size of the last item]
    i, n = 0, len(pattern)

    def item(size: int) -> None:
        stack[-1][0] += size
        stack[-1][1] = size

    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            if i <= n and pattern[i - 1] in "pPx" and i < n and pattern[i] == "{":
                i = pattern.find("}", i) + 1 or n
            item(1)
            continue
        if c == "[":
            i = _class_end(pattern, i)
            item(1)
            continue
        if c == "(":
            stack.append([0, 0])
        elif c == ")" and len(stack) > 1:
            size = stack.pop()[0]
            item(size)
        elif c in "*+?":
            stack[-1][0] += stack[-1][1]  # one more copy of the item (a loop back)
        elif c == "{":
            m = re.match(r"\{(\d+)(,(\d*))?\}", pattern[i:])
            if m:
                low = int(m.group(1))
                high = int(m.group(3)) if m.group(3) else (low + 1 if m.group(2) else low)
                last = stack[-1][1]
                stack[-1][0] += last * (max(high, 1) - 1)
                stack[-1][1] = last * max(high, 1)
                i += m.end()
                continue
            item(1)
        elif c not in "|^$":
            item(1)
        i += 1
    while len(stack) > 1:  # an unclosed group: the library reports it
        size = stack.pop()[0]
        item(size)
    return stack[0][0]


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opening at ``pattern[i]`` ("[")."""
    n, j = len(pattern), i + 1
    if j < n and pattern[j] == "^":
        j += 1
    if j < n and pattern[j] == "]":
        j += 1
    depth = 1
    while j < n and depth:
        if pattern[j] == "\\":
            j += 1
        elif pattern[j] == "[":
            depth += 1
        elif pattern[j] == "]":
            depth -= 1
        j += 1
    return j


def check_regex(pattern: str, field: str) -> None:
    states = regex_states(pattern)
    if states > MAX_REGEX_STATES:
        raise ValueError(
            f"{field}: the pattern's repetitions expand to about {states:,} states, more than "
            f"the limit of {MAX_REGEX_STATES:,} (nested or large counted repetitions such as "
            "(?:a{1000}){1000})"
        )


def schema_patterns(schema: Any):
    """Every regex a JSON schema holds: ``pattern`` values and ``patternProperties`` keys."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                yield node["pattern"]
            if isinstance(node.get("patternProperties"), dict):
                yield from (k for k in node["patternProperties"] if isinstance(k, str))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
