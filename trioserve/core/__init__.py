"""The API-neutral serving core: a request model every API maps to (``request``), the typed
events of a generation (``events``), the output pipeline that produces them (``pipeline``)
and the core that renders, admits and runs requests (``serving``)."""
