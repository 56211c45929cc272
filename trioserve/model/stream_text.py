"""Text that arrives in pieces: how much of its end must be held back because it could still
become a marker (a reasoning tag, a tool-call start, a stop string) once the next piece
arrives. Pure."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["partial_marker_len"]


def partial_marker_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker (0:
    nothing to hold back)."""
    longest = max((len(m) for m in markers), default=1) - 1
    for n in range(min(len(text), longest), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) and len(m) > n for m in markers):
            return n
    return 0
