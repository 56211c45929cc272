"""The raw-prompt endpoints (``/v1/completions``, ``/tokenize``, ``/detokenize``): request models
(``models``) and the adapter (``adapter``)."""
