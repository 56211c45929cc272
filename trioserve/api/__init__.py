"""The HTTP APIs, one package per dialect, over the API-neutral serving core (``trioserve.core``).

An adapter validates its API's request body, maps it to a ``CoreRequest``, starts a ``Turn``
on the shared ``ServingCore`` and writes the turn's events in its own wire format (JSON or
server-sent events) and its own error shape:

- ``chat``: OpenAI Chat Completions (``POST /v1/chat/completions``);
- ``responses``: OpenAI Responses (``POST /v1/responses``);
- ``messages``: Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``);
- ``completions``: the raw-prompt endpoints (``POST /v1/completions``, ``/tokenize``,
  ``/detokenize``) over the core's raw prompts: no template, no reasoning split, no tool calls.

The four packages are peers and none imports another (tests/unit/test_layers.py); what they
share lives here, at the top level:

- ``body``: the building blocks of the body models (strict base model, Unicode-checked text,
  integral numbers, discriminated unions, ``stop``, ``stream_options``, the router-written
  defaults);
- ``validation``: stages 1-3 of the validation order (size, JSON object, the model's types
  with pydantic's first error translated) and stage 4's "set to something other than" check;
- ``streaming``: the SSE skeleton every streamed answer runs, and OpenAI's event framing;
- ``answers``: what an adapter answers with (``JsonResponse``, ``StreamResponse``), the
  ``GeneratingAPI`` every generating route calls (``http/route_support.py``), OpenAI's usage;
- ``ignored_fields``: the ``x-trioserve-ignored-fields`` header.

Nothing here imports quart, hypercorn or the worker: routes live in ``trioserve.http``.
"""
