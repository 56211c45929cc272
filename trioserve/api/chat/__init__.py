"""OpenAI Chat Completions: request models (``models``), body validation (``validation``), the
adapter over the serving core (``adapter``) and the chunk framing (``sse``)."""
