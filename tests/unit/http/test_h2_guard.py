"""The HTTP/2 guard's task group (trioserve/http/h2_guard.py) on hypercorn's own trio task
group: what the connection's reading task hands a stream's handler never waits on a handler
that has ended."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.trio.task_group import TaskGroup

from trioserve.http.h2_guard import HandlerTaskGroup


async def test_a_body_put_for_a_handler_that_ended_without_reading_it_returns():
    # hypercorn hands a stream's body to its handler through a queue of max_app_queue_size
    # messages, and the connection's reading task waits while it is full. A handler that
    # answered without reading the body (a 404) and returned never empties it: the reading
    # task waited forever, and with it every stream of the connection.
    config = Config()
    answered = trio.Event()
    ended: list[Any] = []
    delivered = 0

    async def app(scope: Any, receive: Any, send: Any, *spawn: Any) -> None:
        await answered.wait()  # answers without reading the body

    async def send(message: Any) -> None:
        ended.append(message)

    async with TaskGroup() as hypercorn_tasks:
        tasks = HandlerTaskGroup(hypercorn_tasks)
        put = await tasks.spawn_app(app, config, {"type": "http"}, send)

        async def deliver_body() -> None:  # what the reading task does, frame by frame
            nonlocal delivered
            for _ in range(config.max_app_queue_size + 5):
                await put({"type": "http.request", "body": b" " * 1000, "more_body": True})
                delivered += 1

        with trio.fail_after(10):
            async with trio.open_nursery() as reading:
                reading.start_soon(deliver_body)
                await trio.testing.wait_all_tasks_blocked()
                assert delivered == config.max_app_queue_size  # full: the next put waits
                answered.set()
        assert ended == [None] and tasks.running == 0
        await put({"type": "http.disconnect"})  # a later put returns at once
