"""What an API adapter answers a request with when it does not fail: a whole JSON body
(:class:`JsonResponse`), or an event stream (each adapter's own ``…Stream``), each with the
response headers the adapter adds (``x-trioserve-ignored-tools``, ``x-trioserve-ignored-fields``:
spec/README.md §20.4, §4.1). The HTTP layer writes them; nothing here does I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["JsonResponse"]


@dataclass(frozen=True)
class JsonResponse:
    """A whole response: the body object and the response ``headers``."""

    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
