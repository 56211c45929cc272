"""Sessions as trees: the branches of a session key, and where a prompt stopped matching
(spec §12 "Branches" and "Divergence report").

A session key (``core/sessions.py``) may hold several **branches**, each its own worker
session (its own slot, or spilled state). An agent harness sends its sub-agents, compaction
and title requests under the main conversation's key; each of those prompts diverges from
the main conversation's, and run in one worker session it would overwrite the main
conversation's state (the main conversation's next turn then computes everything again).
So a request runs in the branch whose conversation it **extends** (every message the branch
held, unchanged, followed by new ones); a request that extends no branch opens a new one.
The worker starts the new branch from the longest shared prefix of any state it holds
(spec/worker-protocol.md §6.2: a copy of the other branch's slot or spilled state), and the
branch it diverged from stays as it was.

Decided here, in the control plane, and not in the worker: which branch a prompt belongs to
is a question about *messages* (did the client send the branch's conversation back
unchanged?), which the worker never sees; at token level a thinking template's next turn
also "diverges" (it drops the previous turn's reasoning), while at message level it extends.
The worker only needs distinct session names (``key`` for a key's first branch, then ``key``
+ :data:`BRANCH_SEPARATOR` + label), routed by the key (``worker/routing.py``), so that the prefix copy finds the source.

Comparison is by message digests (a request's :class:`Shape`), so the table holds no
conversation text: per message a digest of what the template reads, per system message a
digest per line (to name a changed line), and digests of the tools and the options that
change the rendering. A harness's agent id (``SessionKey.agent``) names the branch directly.

Bounds: ``max_branches`` per key (the least recently used idle branch is evicted; over the
bound only while every other branch is generating), ``max_keys`` keys (least recently used
forgotten; their worker sessions age out by the worker's own LRU). Pure bookkeeping: no I/O,
no Trio; ``core/session_branches.py`` closes evicted branches' worker sessions.
"""

from __future__ import annotations

import collections
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from trioserve.core.sessions import SessionKey

__all__ = ["BRANCH_SEPARATOR", "DEFAULT_MAX_BRANCHES", "MAX_KEYS", "Branch", "BranchTable",
           "Divergence", "Placement", "Shape", "shape_of"]

# Joins a key and a branch label into a worker session name. A control character: a valid
# client key holds none (sessions.validate_session_key), so no client key names a branch.
# worker/routing.py keeps the same value (a test pins them together).
BRANCH_SEPARATOR = "\x1f"
DEFAULT_MAX_BRANCHES = 4
MAX_KEYS = 1024  # as the replay store's bound (core/replay.py)


def _digest(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True, default=str,
                      separators=(",", ":"))
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


@dataclass(frozen=True, slots=True)
class Shape:
    """What a request's prompt is made of, as digests: ``tools`` (the tools shown to the
    template), ``options`` (the other inputs of the rendering: template variables, reasoning
    switch), ``messages`` (one per message, all it renders from), ``roles``, and ``lines``
    (per message: a digest per line for a system message, None for the others)."""

    tools: str
    options: str
    messages: tuple[str, ...]
    roles: tuple[str, ...]
    lines: tuple[tuple[str, ...] | None, ...]


def shape_of(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
             options: Any = None) -> Shape:
    """The :class:`Shape` of template ``messages`` (``CoreRequest.template_messages``), the
    template ``tools`` and ``options`` (any JSON-able value). O(size of the conversation)."""
    return Shape(
        tools=_digest(tools), options=_digest(options),
        messages=tuple(_digest(m) for m in messages),
        roles=tuple(str(m.get("role")) for m in messages),
        lines=tuple(tuple(_digest(line) for line in str(m.get("content", "")).split("\n"))
                    if m.get("role") == "system" else None for m in messages))


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a request stopped matching the branch it was compared with (``branch``, its
    label) and what changed: ``change`` is ``"tools"``, ``"options"`` (template variables or
    the reasoning switch), ``"role"``, ``"system_line"`` (one or more lines of a system
    message; ``line`` is the first changed one, 0-based), ``"text"`` (the message's content,
    calls or name), ``"removed"`` (the request ends before the branch's message) or
    ``"added"`` (another message sits where the branch's conversation ended: never for an
    extension). ``message_index``: the first message that differs (0 for tools and options:
    they render before the first message in every common template)."""

    message_index: int
    change: str
    branch: str
    line: int | None = None

    def report(self, *, token_offset: int, new_branch: bool, held_messages: int) -> dict[str, Any]:
        """The usage extension ``trioserve_divergence`` (spec §12)."""
        out: dict[str, Any] = {"message_index": self.message_index, "change": self.change,
                               "token_offset": token_offset, "branch": self.branch,
                               "new_branch": new_branch, "branch_messages": held_messages}
        if self.line is not None:
            out["line"] = self.line
        return out

    def log_text(self) -> str:
        """One log token: ``msg3:text``, ``msg0:system_line4``, ``msg0:tools``."""
        line = "" if self.line is None else str(self.line)
        return f"msg{self.message_index}:{self.change}{line}"


def _shared(new: Shape, held: Shape) -> int:
    """How many leading messages ``new`` shares with ``held``; -1 when the tools or options
    differ (the prompts diverge before the first message)."""
    if new.tools != held.tools or new.options != held.options:
        return -1
    n = 0
    for a, b in zip(new.messages, held.messages):
        if a != b:
            break
        n += 1
    return n


def divergence(new: Shape, held: Shape, label: str) -> Divergence | None:
    """Where ``new`` stops matching ``held`` (None: ``new`` extends it)."""
    if new.tools != held.tools:
        return Divergence(0, "tools", label)
    if new.options != held.options:
        return Divergence(0, "options", label)
    i = _shared(new, held)
    if i == len(held.messages):
        return None
    if i == len(new.messages):
        return Divergence(i, "removed", label)
    if new.roles[i] != held.roles[i]:
        return Divergence(i, "role", label)
    new_lines, held_lines = new.lines[i], held.lines[i]
    if new_lines is not None and held_lines is not None:
        first = next((k for k, (a, b) in enumerate(zip(new_lines, held_lines)) if a != b),
                     min(len(new_lines), len(held_lines)))
        return Divergence(i, "system_line", label, line=first)
    return Divergence(i, "text", label)


@dataclass(slots=True)
class Branch:
    """One branch: its worker session ``name``, its ``label`` (``"#1"``, ``"#2"``, … or the
    agent id), the :class:`Shape` of its latest request and when it was last used (a tick)."""

    name: str
    label: str
    shape: Shape
    used: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs: worker session ``name`` of branch ``label`` of ``key``;
    ``opened`` when the branch is new; ``source``: the label of the branch it was compared
    with (the one it continues, else the nearest, the likely copy source; None when the key
    held nothing); ``divergence``: where the request stopped matching that branch (None: it
    extends it, or the key held nothing); ``held_messages``: that branch's message count."""

    key: str
    name: str
    label: str
    opened: bool
    source: str | None = None
    divergence: Divergence | None = None
    held_messages: int = 0
    evicted: int = 0  # branches of the key evicted to make room (set by the caller)


@dataclass
class _Key:
    branches: dict[str, Branch] = field(default_factory=dict)  # by label
    opened: int = 0  # branches opened so far: the next label


class BranchTable:
    """The branches of every session key (module docstring). Counters for ``/metrics``:
    ``opened`` (branches opened beyond a key's first), ``evictions``."""

    def __init__(self, max_branches: int = DEFAULT_MAX_BRANCHES, max_keys: int = MAX_KEYS) -> None:
        if max_branches < 1 or max_keys < 1:
            raise ValueError("max_branches and max_keys must be at least 1")
        self.max_branches = max_branches
        self.max_keys = max_keys
        self._keys: collections.OrderedDict[str, _Key] = collections.OrderedDict()
        self._tick = 0
        self.opened = 0
        self.evictions = 0

    def names(self, key: str) -> list[str]:
        """The worker session names of ``key``'s branches (``[key]`` when it holds none: a
        key is its first branch's name)."""
        entry = self._keys.get(key)
        names = [b.name for b in entry.branches.values()] if entry is not None else []
        return names if key in names else [key, *names]

    def forget(self, key: str) -> list[str]:
        """Drop ``key``'s branches; their worker session names (as :meth:`names`)."""
        names = self.names(key)
        self._keys.pop(key, None)
        return names

    def branch_count(self) -> int:
        """Branches held over every key."""
        return sum(len(entry.branches) for entry in self._keys.values())

    def place(self, session: SessionKey, shape: Shape) -> Placement:
        """Choose (or open) the branch of ``session`` for a request of ``shape``. A branch
        opened beyond the bound is left to the caller to evict (:meth:`eviction_order`).
        Never raises."""
        self._tick += 1
        entry = self._keys.pop(session.key, None) or _Key()
        self._keys[session.key] = entry  # most recently used last
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        branch, nearest = self._choose(entry, session, shape)
        if branch is not None:  # continue it
            return self._use(session.key, branch, shape, opened=False, source=branch)
        # Numbered labels start with '#': an agent id never collides with one.
        label = session.agent if session.agent is not None else f"#{entry.opened + 1}"
        name = session.key if entry.opened == 0 else session.key + BRANCH_SEPARATOR + label
        if entry.opened > 0:
            self.opened += 1
        entry.opened += 1
        branch = Branch(name, label, shape, self._tick)
        entry.branches[label] = branch
        return self._use(session.key, branch, shape, opened=True, source=nearest)

    def eviction_order(self, placement: Placement) -> list[str]:
        """Worker session names to evict, least recently used first, while ``placement``'s
        key holds more than ``max_branches`` branches: never the placed branch nor its source
        (the new branch's likely copy source). The caller evicts what it can (a branch
        generating cannot be) with :meth:`evicted`, in this order, until within the bound."""
        entry = self._keys.get(placement.key)
        if entry is None or len(entry.branches) <= self.max_branches:
            return []
        keep = {placement.label, placement.source}
        victims = sorted((b for b in entry.branches.values() if b.label not in keep),
                         key=lambda b: b.used)
        return [b.name for b in victims][:len(entry.branches) - self.max_branches]

    def evicted(self, key: str, name: str) -> None:
        """The caller freed worker session ``name`` of ``key``: forget its branch."""
        entry = self._keys.get(key)
        if entry is None:
            return
        for label, branch in list(entry.branches.items()):
            if branch.name == name:
                del entry.branches[label]
                self.evictions += 1

    def over_bound(self, key: str) -> bool:
        entry = self._keys.get(key)
        return entry is not None and len(entry.branches) > self.max_branches

    def _choose(self, entry: _Key, session: SessionKey,
                shape: Shape) -> tuple[Branch | None, Branch | None]:
        """(the branch to continue, else None; the nearest branch to report against)."""
        branches = list(entry.branches.values())
        nearest = max(branches, key=lambda b: (_shared(shape, b.shape), b.used), default=None)
        if self.max_branches == 1 and branches:
            return branches[0], nearest  # branching off: one branch, overwritten
        if session.agent is not None:
            return entry.branches.get(session.agent), nearest
        extended = [b for b in branches if _shared(shape, b.shape) == len(b.shape.messages)]
        # The longest conversation it extends; ties: the most recently used.
        best = max(extended, key=lambda b: (len(b.shape.messages), b.used), default=None)
        return best, nearest

    def _use(self, key: str, branch: Branch, shape: Shape, *, opened: bool,
             source: Branch | None) -> Placement:
        report = divergence(shape, source.shape, source.label) if source is not None else None
        held = len(source.shape.messages) if source is not None else 0
        branch.shape = shape
        branch.used = self._tick
        return Placement(key, branch.name, branch.label, opened,
                         source.label if source is not None else None, report, held)
