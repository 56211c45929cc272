"""OpenAI Responses: request parsing (``request``) and the adapter with its stored responses
(``adapter``)."""
