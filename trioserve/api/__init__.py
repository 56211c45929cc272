"""The HTTP APIs, one adapter module each, over the API-neutral serving core (``trioserve.core``).

An adapter validates its API's request body, maps it to a ``CoreRequest``, starts a ``Turn``
on the shared ``ServingCore`` and writes the turn's events in its own wire format (JSON or
server-sent events) and its own error shape:

- ``chat``: OpenAI Chat Completions (``POST /v1/chat/completions``);
- ``responses``: OpenAI Responses (``POST /v1/responses``);
- ``messages`` (with ``messages_wire``, ``messages_routes``): Anthropic Messages
  (``POST /v1/messages``, ``/v1/messages/count_tokens``).

The legacy and helper endpoints (``completions``, ``legacy_models``, ``legacy_routes``:
``POST /v1/completions``, ``/tokenize``, ``/detokenize``) take raw prompts, so they run on the
runtime directly: no template, no reasoning split, no tool calls.
"""
