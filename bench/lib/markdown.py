"""Sections of a docs/benchmarks/ page that one benchmark owns, between its own begin/end
markers, so each benchmark rewrites only its part of the page."""

from __future__ import annotations

from pathlib import Path

# Every section bench/contention_bench.py writes: <!-- contention[-NAME]:begin ... -->; the main
# report keeps them when it rewrites the file.
CONTENTION_PREFIX = "<!-- contention"


def replace_section(path: Path, begin: str, end: str, block: str, *, before: str | None = None,
                    empty: str = "") -> None:
    """Put ``block`` (which holds its own ``begin`` and ``end`` markers) in place of the text
    from ``begin`` to ``end`` in ``path``; when the markers are absent, insert it before the
    first ``before`` text, or append it. A missing file starts as ``empty``."""
    text = path.read_text() if path.exists() else empty
    if begin in text and end in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = head + block + tail
    elif before is not None and before in text:
        head, _, tail = text.partition(before)
        text = head.rstrip("\n") + "\n\n" + block + "\n" + before + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def kept_sections(text: str, prefix: str = CONTENTION_PREFIX) -> str:
    """Everything from the first ``prefix`` section's begin marker to the last end marker (""
    if none): what a rewrite of the whole file keeps."""
    start = text.find(prefix)
    last_end = text.rfind(":end -->")
    if start < 0 or last_end < start:
        return ""
    return text[start:last_end + len(":end -->")]
