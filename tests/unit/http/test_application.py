"""AsgiWrapper runs request-end callbacks however the request ends, and shields only the
final body send."""

import pytest
import trio

from trioserve.http.application import AsgiWrapper, call_at_request_end


async def test_callbacks_run_when_the_request_is_cancelled_before_the_body():
    called = []

    async def app(scope, receive, send):
        call_at_request_end(lambda: called.append("cancelled stream"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await trio.sleep_forever()  # the client went away before the first body chunk

    async def send(message):
        pass

    with trio.move_on_after(0.05):
        await AsgiWrapper(app)({"type": "http"}, None, send)
    assert called == ["cancelled stream"]


async def test_callbacks_run_on_error_and_on_success():
    called = []

    async def failing(scope, receive, send):
        call_at_request_end(lambda: called.append("failed"))
        raise RuntimeError("boom")

    async def fine(scope, receive, send):
        call_at_request_end(lambda: called.append("fine"))

    with pytest.raises(RuntimeError):
        await AsgiWrapper(failing)({"type": "http"}, None, None)
    await AsgiWrapper(fine)({"type": "http"}, None, None)
    assert called == ["failed", "fine"]


async def test_only_the_final_body_send_is_shielded():
    sent = []

    async def send(message):
        await trio.sleep(0.01)  # a checkpoint: cancellable unless shielded
        sent.append(message.get("more_body", False))

    async def app(scope, receive, send_):
        with trio.CancelScope() as scope_:
            scope_.cancel()
            with pytest.raises(trio.Cancelled):
                await send_({"type": "http.response.body", "body": b"a", "more_body": True})
            await send_({"type": "http.response.body", "body": b"", "more_body": False})

    await AsgiWrapper(app)({"type": "http"}, None, send)
    assert sent == [False]
