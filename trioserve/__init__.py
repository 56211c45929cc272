"""trioserve: an OpenAI-compatible LLM server with a Trio control plane over a C++ model worker.

The control plane is five layers, each a package with one rule about what it may import
(checked by tests/unit/test_layers.py):

- ``http``: the server, connection handling, guard, routes, request log, router headers,
  metrics and the composition root (``http.services``). May import every layer.
- ``api``: one package per API dialect (``chat``, ``responses``, ``messages``,
  ``completions``): request models and parsing, the adapter, the wire encoder. The four are
  peers: what they share (body types and validation, the stream skeleton and SSE framing, the
  answer types) lives at ``api/``'s top level, and no API package imports another. Imports
  ``core``, ``model`` and the leaves; never ``http``, ``worker``, quart or hypercorn.
- ``core``: the API-neutral request, typed events, the output pipeline, the serving core
  (chat turns, raw prompts, token counts), constraints, replay, sessions. Imports ``model``,
  the worker's protocol types and runtime interface (``worker.protocol``, ``worker.runtime``,
  ``worker.tokenize_gate``)
  and the leaves.
- ``model``: chat templates, profiles, reasoning markers, tool-call formats and grammars. Pure:
  no I/O, imports only the leaves.
- ``worker``: the sans-IO codec, the client, the child process, the runtime (one worker's
  admission and multiplexer), the supervisor, the pool and its routing. Imports only the leaves.

Leaves (``config``, ``errors``, ``hub``, ``limits``, ``machine``, ``registry``, ``strict_json``)
import only each other (``hub`` resolves ``hf:`` model references through the
``huggingface_hub`` library); the entry points (``cli``, ``app``, ``testing``) import ``http``,
the leaves and (for types) ``worker``.
"""

__version__ = "0.1.0"
