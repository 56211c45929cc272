"""Which worker of a pool serves a request: pure routing policy, no I/O, no Trio.

Three rules (``WorkerPool.submit`` applies them, in this order):

1. **A keyed request** (a session key, spec §12; every branch of a key alike,
   :func:`routing_key`) goes to its key's worker: the first in the
   key's rendezvous order (:func:`key_order`, highest-random-weight hashing over the worker
   indexes with BLAKE2b, so the choice is the same in every process and run, and for a given
   key depends only on the number of workers). Its session's KV state lives there, so every
   turn reuses it. While that worker is not serving (restarting, given up), the key moves to
   the next worker of its order that is, and comes back when the first serves again (the
   restarted worker holds nothing of the session then anyway; the core's token-id replay
   keeps the prompt identical, so the new worker re-prefills it once).
2. **An anonymous request** goes to the serving worker whose recently sent anonymous prompts
   share the longest prefix with it (:class:`ResidentPrefixes`; at least
   ``MIN_SHARED_PREFIX_CHARS``), so the worker's slot prefix reuse finds it, unless that
   worker has no free slot while another has one.
3. Otherwise the **least loaded** serving worker: fewest generations running or queued per
   slot, ties to the lowest index.

With one worker every rule returns that worker. The prefix record is an approximation of
what the worker holds (like a router's approximate prefix-cache scoring): the worker keeps a
slot's prompt until another prompt evicts it, and the pool remembers the last
``ResidentPrefixes.limit`` anonymous prompts per worker (forgotten at each restart).
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass
from typing import Sequence

from trioserve.worker.protocol import GenerateParams, IdsSegment

__all__ = ["BRANCH_SEPARATOR", "MIN_SHARED_PREFIX_CHARS", "Load", "ResidentPrefixes",
           "choose_anonymous", "common_prefix_len", "key_order", "prompt_text", "routing_key"]

# A session's branches are worker sessions named ``key`` + this + a label (core/branches.py,
# which keeps the same value: a test pins them together). A control character: no client
# key holds one.
BRANCH_SEPARATOR = "\x1f"

# Shorter shared prefixes are the chat template's opening (role markers, a default system
# line): every prompt has them, so they must not pull all anonymous traffic onto one worker.
MIN_SHARED_PREFIX_CHARS = 256


def key_order(key: str, workers: int) -> list[int]:
    """Worker indexes ``0..workers-1`` in ``key``'s rendezvous order (best first).

    Stable: the same for a key in every process (no salted ``hash()``). Adding a worker
    moves only the keys that now rank it first.
    """
    def weight(index: int) -> bytes:
        return hashlib.blake2b(f"{index}\x00{key}".encode("utf-8", "surrogatepass"),
                               digest_size=8).digest()

    return sorted(range(workers), key=weight, reverse=True)


def routing_key(session_id: str) -> str:
    """The key a worker session is routed by: its session key, without a branch label, so
    every branch of a key lives on one worker (a new branch starts from a copy of another
    branch's state there: spec/worker-protocol.md §6.2)."""
    return session_id.split(BRANCH_SEPARATOR, 1)[0]


def prompt_text(params: GenerateParams) -> str:
    """The prompt as one string for prefix comparison: the text, or the segments with each
    id run spelled out (ids and text never compare equal by accident: ids start with NUL)."""
    if params.prompt_segments is None:
        return params.prompt
    parts = []
    for segment in params.prompt_segments:
        if isinstance(segment, IdsSegment):
            parts.append("\x00" + ",".join(map(str, segment.ids)) + "\x00")
        else:
            parts.append(segment.text)
    return "".join(parts)


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (binary search over slice
    comparisons: C-speed even for prompts of hundreds of kB)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ResidentPrefixes:
    """The last ``limit`` anonymous prompts sent to one worker (an approximation of what its
    slots hold)."""

    def __init__(self, limit: int = 8) -> None:
        self.limit = limit
        self._prompts: collections.deque[str] = collections.deque(maxlen=limit)

    def add(self, prompt: str) -> None:
        # A prompt extending a remembered one replaces it (the next turn of a conversation).
        for i, held in enumerate(self._prompts):
            if prompt.startswith(held):
                del self._prompts[i]
                break
        self._prompts.append(prompt)

    def longest(self, prompt: str) -> int:
        """The longest prefix of ``prompt`` shared with a remembered prompt."""
        return max((common_prefix_len(prompt, held) for held in self._prompts), default=0)

    def clear(self) -> None:
        self._prompts.clear()


@dataclass(frozen=True)
class Load:
    """A serving worker's occupancy, as routing sees it."""

    index: int
    busy: int  # generations running or queued
    capacity: int  # slots

    @property
    def free(self) -> bool:
        return self.busy < self.capacity

    @property
    def ratio(self) -> float:
        return self.busy / max(1, self.capacity)


def least_loaded(loads: Sequence[Load]) -> int:
    """Index of the least loaded worker (ties: the lowest index). ``loads`` is not empty."""
    return min(loads, key=lambda load: (load.ratio, load.index)).index


def choose_anonymous(loads: Sequence[Load], shared: dict[int, int]) -> int:
    """The worker for an anonymous request (rules 2 and 3 of the module docstring).

    ``loads``: the serving workers (not empty); ``shared``: per worker index, the prefix
    length its remembered prompts share with this request.
    """
    fallback = least_loaded(loads)
    best = max(loads, key=lambda load: (shared.get(load.index, 0), -load.index))
    best_shared = shared.get(best.index, 0)
    if best_shared < MIN_SHARED_PREFIX_CHARS or best_shared <= shared.get(fallback, 0):
        return fallback
    if not best.free and any(load.free for load in loads):
        return fallback
    return best.index
