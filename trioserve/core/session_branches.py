"""The serving core's side of session branches and the divergence report (spec §12): places
a request in its branch (``core/branches.py``), closes the worker sessions of evicted
branches, attaches the report to the answer's usage, the access log and the generation
stats, and remembers turns for token-id replay per branch.

Cancellation: :meth:`SessionBranches.place` may wait for worker session closes (each bounded
by the runtime's call deadline); cancelled meanwhile, a branch whose close did not finish
stays in the table (the worker's own LRU evicts it in time).
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from trioserve.core.branches import BranchTable, Divergence, Placement, shape_of
from trioserve.core.events import Accumulator, Event, Finished
from trioserve.core.offload import prepare
from trioserve.core.replay import ReplayStore, ReplayTurn, message_signature
from trioserve.core.request import CoreRequest
from trioserve.core.sessions import SessionKey
from trioserve.worker.runtime import Generation, GenerationError

__all__ = ["ACCESS_NOTES", "ANONYMOUS", "SessionBranches", "remember_turn", "with_divergence"]

log = logging.getLogger("trioserve.sessions")

# Notes for the current HTTP request's access log line (http/access_log.py sets a fresh list
# per request; the serving core appends ``divergence=…``). None outside a request.
ACCESS_NOTES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "trioserve_access_notes", default=None)

# The table's key for anonymous requests: reports only (the empty string is no valid key).
ANONYMOUS = SessionKey("", "anonymous")


class SessionBranches:
    """Branch placement for one model's core. ``opened`` / ``evictions`` / ``divergences``
    (by change) count for ``/metrics`` (read through the generation stats)."""

    def __init__(self, runtime: Any, max_branches: int) -> None:
        self.runtime = runtime
        self.table = BranchTable(max_branches=max_branches)
        # Anonymous prompts, compared for the report only (no worker session is named).
        self.anonymous = BranchTable(max_branches=max_branches, max_keys=1)

    async def place(self, req: CoreRequest, messages: list[dict[str, Any]], *,
                    large: bool) -> Placement:
        """The branch ``req`` runs in (``messages``: its template messages), after evicting
        what the bound asks for. For an anonymous request, a placement in the anonymous
        table whose ``name`` must not be used (its divergence is the report's only use)."""
        shape = await prepare(lambda: shape_of(messages, req.template_tools(), _options(req)),
                              large=large)
        if req.session is None:
            placement = self.anonymous.place(ANONYMOUS, shape)
            for name in self.anonymous.eviction_order(placement):
                self.anonymous.evicted(ANONYMOUS.key, name)
            return placement
        placement = self.table.place(req.session, shape)
        evicted = 0
        for name in self.table.eviction_order(placement):
            if await self._close(name):
                self.table.evicted(placement.key, name)
                evicted += 1
            if not self.table.over_bound(placement.key):
                break
        return dataclasses.replace(placement, evicted=evicted)

    async def _close(self, name: str) -> bool:
        """Free worker session ``name``; False while it is generating (it stays)."""
        close = getattr(self.runtime, "close_session", None)
        if close is None:  # a runtime without sessions (tests' stand-ins)
            return True
        try:
            await close(name)
        except GenerationError as exc:
            if exc.code == "session_busy":
                return False
            log.warning("could not close evicted branch %r: %s", name, exc.message)
        return True

    def forget(self, key: str) -> list[str]:
        """Drop ``key``'s branches; the worker session names to close (``DELETE``)."""
        return self.table.forget(key)


def _options(req: CoreRequest) -> Any:
    """What else changes the rendering: a changed value renders another prompt."""
    return [req.reasoning_effort, sorted(req.template_kwargs.items(), key=lambda kv: kv[0]),
            req.answer_prefix]


def _reported(placement: Placement | None) -> Divergence | None:
    """The divergence to report: an anonymous request's only when its nearest prompt shared
    at least one message (else it is another conversation, not a lost prefix)."""
    div = placement.divergence if placement is not None else None
    if div is None or (placement is not None and placement.key == ANONYMOUS.key
                       and div.message_index == 0):
        return None
    return div


def with_divergence(placement: Placement | None, events: Sequence[Event]) -> list[Event]:
    """``events`` with the divergence report in the :class:`Finished` event's usage, and the
    access log note, when ``placement`` diverged (:func:`_reported`)."""
    out = list(events)
    div = _reported(placement)
    if placement is None or div is None:
        return out
    for i, event in enumerate(out):
        if isinstance(event, Finished):
            usage = event.usage
            extension = div.report(token_offset=usage.cached_tokens,
                                   new_branch=placement.opened and placement.key != ANONYMOUS.key,
                                   held_messages=placement.held_messages)
            out[i] = dataclasses.replace(event, usage=dataclasses.replace(usage, divergence=extension))
            notes = ACCESS_NOTES.get()
            if notes is not None:
                notes.append(f"divergence={div.log_text()}@{usage.cached_tokens}")
    return out


def stats_extra(placement: Placement) -> dict[str, Any]:
    """The generation stats' branch fields (core/stats.py) for ``placement``."""
    div = _reported(placement)
    return {"branch_opened": placement.opened and placement.name != placement.key,
            "branch_evictions": placement.evicted,
            "divergence": div.change if div is not None else None}


def remember_turn(replay: ReplayStore, placement: Placement | None, req: CoreRequest,
                  gen: Generation, acc: Accumulator) -> None:
    """Remember this turn's generated ids for replay (spec §12) in the request's branch's
    worker session (``placement``; nothing for an anonymous request) when they are exactly
    what the client was answered: the pipeline delivered its ending, nothing was cut or
    dropped, no reasoning text. Never raises (runs in ``finally`` blocks)."""
    if req.session is None or placement is None:
        return
    name = placement.name
    try:
        done, finished = gen.done, acc.finished
        if done is None or done.cancelled or finished is None or finished.dropped_text:
            return
        ids = done.generated_token_ids
        result = acc.result
        if not ids or result.reasoning:
            return
        calls = [{"function": {"name": c.name, "arguments": c.arguments}}
                 for c in result.tool_calls]
        signature = message_signature(result.text, calls)
        if signature is not None:
            replay.record(name, req.template_messages(), ReplayTurn(signature, ids))
    except Exception:
        log.exception("could not remember the turn for replay")
