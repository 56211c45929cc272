"""The HTTP layer: the hypercorn server and its isolated connections (``server``, ``connection``),
the guard (Host, API key, content type), routes, the request log, the headers routers read
(``router_facing``), ``/metrics`` and the composition root (``services``, ``application``)."""
