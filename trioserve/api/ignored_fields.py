"""Fields inside a conversation item that the server does not know (spec/README.md §4.1).

The rule, the same for every API:

- **Top-level parameters stay strict**: an unknown one is ``400 unsupported_parameter``
  (each API's own check), because a parameter changes what is generated.
- **Inside conversation items** — Chat's ``messages[i]`` with their content parts and tool
  calls, Responses' ``input[i]`` items and their content parts, Messages' ``messages[i]``,
  content blocks and ``system`` blocks — each API decides per item type which keys it knows:
  the ones it uses (they change what the model sees) and the echoes it accepts without use
  (ids, statuses, ``cache_control``: listed in the spec). A known key that would change what
  the model sees and that the server cannot honour is refused by the API, never dropped. Any
  **other** key is harness metadata (Codex's ``internal_chat_message_metadata_passthrough``):
  accepted, not used, and reported — the ``x-trioserve-ignored-fields`` response header names
  it, and a DEBUG line logs it. A strict allow-list here would lock a harness out on every
  release that adds such a field.

Ignored fields are still part of the body: the body's bounds (size, nesting, JSON objects,
conversation items; §15) count them like any other field. This module only collects and
reports their paths, in bounded memory whatever their number. Pure.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Container, Mapping
from typing import Any

__all__ = ["IGNORED_FIELDS_HEADER", "HEADER_BUDGET", "IgnoredFields", "response_headers"]

IGNORED_FIELDS_HEADER = "x-trioserve-ignored-fields"

# The header's value stays under this many characters (paths that do not fit are counted in a
# final "(+N more)"): proxies refuse large response headers (nginx's default buffer for all of
# them is 4 KiB), and a client that sent hundreds of such fields learns enough from the first.
HEADER_BUDGET = 1024

# Paths kept per request; the rest are only counted. More could never fit the header.
MAX_KEPT = 64

# Keys shown as they are in a path; any other key is shown JSON-quoted in ASCII with its commas
# escaped (the header is a comma-separated list), cut to KEY_SHOWN_CHARS characters first.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_\-]{1,64}")
KEY_SHOWN_CHARS = 64


def _path(where: str, key: str) -> str:
    if _PLAIN_KEY.fullmatch(key):
        return f"{where}.{key}"
    quoted = json.dumps(key[:KEY_SHOWN_CHARS], ensure_ascii=True).replace(",", "\\u002c")
    return f"{where}[{quoted}]"


class IgnoredFields:
    """The unknown keys one request carries inside its conversation items, in body order.

    ``note`` is called by the API's parser for each item (and part, block, call) once the
    item's type is known; only the first :data:`MAX_KEPT` paths are kept, ``total`` counts
    them all. Invariant: ``len(paths) == min(total, MAX_KEPT)``.
    """

    __slots__ = ("paths", "total")

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.total = 0

    def note(self, obj: Mapping[str, Any], known: Container[str], where: str) -> None:
        """Record every key of ``obj`` (the item at path ``where``) not in ``known``."""
        for key in obj:
            if key in known:
                continue
            self.total += 1
            if len(self.paths) < MAX_KEPT:
                self.paths.append(_path(where, key))

    def __bool__(self) -> bool:
        return self.total > 0

    def header_value(self) -> str:
        """The paths, comma-separated, within :data:`HEADER_BUDGET` characters; those left out
        are counted in a last ``(+N more)`` entry. Printable ASCII only."""
        shown: list[str] = []
        size = 0
        for path in self.paths:
            # Room for this path and its separator, and for a "(+N more)" after it.
            if size + len(path) + 2 > HEADER_BUDGET - 16:
                break
            shown.append(path)
            size += len(path) + 2
        if len(shown) < self.total:
            shown.append(f"(+{self.total - len(shown)} more)")
        return ", ".join(shown)


def response_headers(ignored: IgnoredFields, log: logging.Logger, request_id: str) -> dict[str, str]:
    """The ``x-trioserve-ignored-fields`` header for a request that carried ignored fields
    (none otherwise), and its DEBUG line on ``log``."""
    if not ignored:
        return {}
    value = ignored.header_value()
    log.debug("request %s: %d field(s) inside conversation items not used by the model: %s",
              request_id, ignored.total, value)
    return {IGNORED_FIELDS_HEADER: value}
