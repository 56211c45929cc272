"""The HTTP APIs, one package per dialect, over the API-neutral serving core (``trioserve.core``).

An adapter validates its API's request body, maps it to a ``CoreRequest``, starts a ``Turn``
on the shared ``ServingCore`` and writes the turn's events in its own wire format (JSON or
server-sent events) and its own error shape:

- ``chat``: OpenAI Chat Completions (``POST /v1/chat/completions``);
- ``responses``: OpenAI Responses (``POST /v1/responses``);
- ``messages``: Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``);
- ``completions``: the raw-prompt endpoints (``POST /v1/completions``, ``/tokenize``,
  ``/detokenize``) over the core's raw prompts: no template, no reasoning split, no tool calls.

Nothing here imports quart, hypercorn or the worker: routes live in ``trioserve.http``.
"""
