"""The contract between a runtime's two sides: the generations waiting for a slot, the
dispatcher's wake-up, and the requests still arriving.

``SessionRuntime`` (the handler side: ``submit``, ``arrival``) puts generations in and marks
arrivals; the ``WorkerLink``'s dispatcher (the worker side) takes them out in order and sleeps
until something changed. Neither reaches into the other: this object is all they share, and
it owns its state.

Rules:

* **FIFO, bounded by the runtime.** :meth:`put` appends; the runtime checks the bound
  (``queue_depth``) before it puts. The dispatcher walks the queue in order (``iter``) and
  :meth:`take` s the generation it dispatches, which may pass waiting ones (worker protocol
  §6: a generation of a busy session waits behind it).
* **Every change the dispatcher may act on wakes it**: :meth:`put`, the end of an arrival and
  :meth:`wake` (a slot was freed); :meth:`drop` does not (a dropped generation frees nothing).
  :meth:`wait_for_change` sleeps until the next one. The dispatcher checks what it needs and
  then waits, with no checkpoint in between, so no wake-up is lost (trio runs one task at a
  time).
* **Arrivals are counted, never waited on forever**: the dispatcher bounds its wait for them
  (``GATHER_WINDOW``, see ``SessionRuntime.arrival``).

Items are opaque here (the runtime's ``Generation``), so this module depends on nothing of
the runtime's.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Generic, TypeVar

import trio

__all__ = ["WorkQueue"]

T = TypeVar("T")


class WorkQueue(Generic[T]):
    """Waiting generations in FIFO order, the dispatcher's wake-up and the arrival count
    (module docstring). Not thread-safe: one trio run owns it."""

    def __init__(self) -> None:
        self._waiting: collections.deque[T] = collections.deque()
        self._changed = trio.Event()  # set when the dispatcher may have something to do
        self._arriving = 0  # open arrivals: requests being received that may submit soon

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[T]:
        """The waiting items, oldest first (do not put or take while iterating)."""
        return iter(self._waiting)

    # -- the handler side ------------------------------------------------------------------

    def put(self, item: T) -> None:
        """Queue ``item`` last and wake the dispatcher."""
        self._waiting.append(item)
        self._changed.set()

    def drop(self, item: T) -> None:
        """Remove ``item`` if it is still waiting (a cancel while queued); idempotent."""
        try:
            self._waiting.remove(item)
        except ValueError:
            pass

    def arrival_started(self) -> None:
        """A request began to arrive and may soon :meth:`put`."""
        self._arriving += 1

    def arrival_ended(self) -> None:
        """An arrival ended (submitted or gone): a gathering dispatcher re-checks."""
        self._arriving -= 1
        self._changed.set()

    @property
    def arriving(self) -> int:
        """Requests being received that may submit soon."""
        return self._arriving

    # -- the worker side -------------------------------------------------------------------

    def take(self, item: T) -> None:
        """Remove ``item`` to dispatch it. Raises ValueError when it is not waiting."""
        self._waiting.remove(item)

    def take_all(self) -> list[T]:
        """Remove and return every waiting item, oldest first (the worker failed)."""
        items = list(self._waiting)
        self._waiting.clear()
        return items

    def wake(self) -> None:
        """Wake the dispatcher (a slot was freed)."""
        self._changed.set()

    async def wait_for_change(self) -> None:
        """Sleep until the next :meth:`put`, :meth:`arrival_ended` or :meth:`wake`.
        Cancellation: leaves at once; nothing is consumed."""
        self._changed = trio.Event()
        await self._changed.wait()
