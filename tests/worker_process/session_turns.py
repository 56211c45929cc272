"""Helpers of the checkpoint tests (sliding-window and recurrent): a keyed session's turns on a
fake worker, and the same prompt's echo on a fresh worker for comparison."""

from __future__ import annotations

from typing import Any, Callable


def cold_echo(fake: Callable[..., Any], flags: tuple[str, ...], prompt: str) -> str:
    """The echo of `prompt` on a fresh fake worker started with `flags` (nothing reused)."""
    w = fake(*flags)
    texts, done = w.generate(1, prompt=prompt)
    assert done["type"] == "done" and done["reused_prompt_tokens"] == 0, done
    w.close()
    return "".join(texts)


def session_turn(w: Any, rid: int, prompt: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    """One turn of session "s": its text and done record."""
    texts, done = w.generate(rid, prompt=prompt, session_id="s", **fields)
    assert done["type"] == "done", done
    return "".join(texts), done
