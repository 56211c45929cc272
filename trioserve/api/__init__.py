"""The HTTP APIs, one adapter module each, over the API-neutral serving core (``trioserve.core``).

An adapter validates its API's request body, maps it to a ``CoreRequest``, starts a ``Turn``
on the shared ``ServingCore`` and writes the turn's events in its own wire format (JSON or
server-sent events) and its own error shape:

- ``chat``: OpenAI Chat Completions (``POST /v1/chat/completions``);
- ``responses``: OpenAI Responses (``POST /v1/responses``).
"""
