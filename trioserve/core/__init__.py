"""The API-neutral serving core: a request model every API maps to (``request``), the typed
events of a generation (``events``), the output pipeline that produces them (``pipeline``),
the core that renders, admits and runs requests (``serving``), raw prompts and the tokenizer
(``raw``), the runtime interface it needs of the worker side (``runtime``), output
constraints (``constraints``), replay, sessions and the turn floor."""
