"""A repeated-key detector for JSON text, complete or cut short (tests and bench/ use it).

Independent of the worker's key stage (cpp/json_key_guard.h), so it can judge it: a stack of
open containers, each object's keys so far; a string right after ``{`` or ``,`` in an object
is a key, decoded by :mod:`json` (so ``"a"`` and ``"\\u0061"`` are the same key). Text outside
any container is skipped the way the worker skips it.
"""

from __future__ import annotations

import json
from typing import Any


def repeated_key(text: str) -> str | None:
    """The first key that repeats within its object in ``text``, or None. An unfinished
    string at the end is not a key yet."""
    stack: list[tuple[set[str] | None, list[bool]]] = []  # (keys, or None for an array; [expect_key])
    i = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= len(text):
                return None
            top = stack[-1] if stack else None
            if top is not None and top[0] is not None and top[1][0]:
                top[1][0] = False
                key = json.loads(text[i:j + 1])
                if key in top[0]:
                    return key
                top[0].add(key)
            i = j + 1
            continue
        if c in "{[":
            stack.append((set() if c == "{" else None, [c == "{"]))
        elif c in "}]" and stack:
            stack.pop()
        elif c == "," and stack and stack[-1][0] is not None:
            stack[-1][1][0] = True
        i += 1
    return None


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` ``object_pairs_hook`` that refuses a repeated key (ValueError)."""
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError(f"repeated key in {keys}")
    return dict(pairs)
