"""Request guards for a server that should only answer the clients it is meant for.

Owns the decisions: :func:`check_startup` validates the guard settings once (a
``ValueError`` names the setting), and :class:`RequestGuard` looks at one request's Host,
method, Authorization, Content-Type and local address and returns the
:class:`~trioserve.errors.APIError` to answer with, or None. A refused request costs no
body read and never reaches the worker.

Checks, in order (spec/README.md §4, §17):

1. **Host** → ``400 invalid_host`` when missing, repeated or malformed; ``421
   host_not_allowed`` when not on the allow-list. A web page can make a browser talk to a
   loopback server through a DNS name the attacker controls (DNS rebinding); the browser
   then sends that name as Host. Bound to loopback, only loopback names are accepted.
   ``HostCheck`` runs this as ASGI middleware in front of Quart, because Quart's URL
   routing parses the Host first and fails outside any error handler on some values.
2. **API key** → ``401 invalid_api_key``, compared in constant time. ``/health`` is exempt
   (orchestrators probe it without credentials; it reveals nothing private).
   A connection that arrived on a non-loopback address while no key is configured and
   ``allow_no_auth`` is off gets ``403 api_key_required``: ``trioserve serve`` refuses to
   start that way, but ``hypercorn trioserve.app:app --bind 0.0.0.0:…`` binds where the
   settings cannot see.
3. **JSON bodies only** on POST routes → ``415 unsupported_media_type``. Besides telling
   a client what to send, this blocks the cross-site form and ``text/plain`` posts that
   browsers send without a CORS preflight.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from urllib.parse import unquote
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

from trioserve import strict_json
from trioserve.config import Settings
from trioserve.errors import INVALID_REQUEST, SERVER_ERROR, APIError

LOOPBACK_HOST_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
# Routes that answer without an API key.
PUBLIC_PATHS = frozenset({"/health"})


def is_loopback_address(host: str) -> bool:
    """True for ``localhost`` and for any IPv4/IPv6 loopback literal (brackets allowed)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_startup(settings: Settings) -> None:
    """Refuse guard settings that would serve unsafely or cannot work; ValueError says why."""
    if settings.max_connections < 1:
        raise ValueError("TRIOSERVE_MAX_CONNECTIONS must be at least 1")
    parse_allowed_hosts(settings.allowed_hosts)
    if not is_loopback_address(settings.host) and not settings.api_key and not settings.allow_no_auth:
        raise ValueError(
            f"refusing to serve on {settings.host} without an API key: anyone who can reach "
            f"the address could use the model. Set TRIOSERVE_API_KEY (clients send "
            f"'Authorization: Bearer <key>'), or set TRIOSERVE_ALLOW_NO_AUTH=1 if something "
            f"in front of trioserve already authenticates clients")


def parse_allowed_hosts(text: str) -> frozenset[str] | None:
    """``"a, B:80, [::1]"`` → ``{"a", "b", "[::1]"}``; ``"*"`` → None (any host).

    Ports are ignored (the allow-list is about names); an entry that is not a valid
    host name raises ValueError.
    """
    names: set[str] = set()
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if entry == "*":
            return None
        name = host_name(entry)
        if name is None:
            raise ValueError(f"TRIOSERVE_ALLOWED_HOSTS: not a host name: {entry!r}")
        names.add(name)
    return frozenset(names)


def host_name(header: str) -> str | None:
    """The lower-cased name of a Host header value without its port, or None if malformed.

    ``localhost:8000`` → ``localhost``; ``[::1]:8000`` → ``[::1]``; ``a b``, ``x:port``,
    ``[::1``, a label over 63 or a name over 253 characters → None.
    """
    value = header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[: end + 1], value[end + 1:]
        try:
            ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            return None
    else:
        name, sep, port = value.partition(":")
        rest = sep + port
        if not name or not all(c.isascii() and (c.isalnum() or c in "-._") for c in name):
            return None
        if len(name) > 253 or any(len(label) > 63 for label in name.split(".")):
            return None
    # A port in ASCII digits only ('x:²' or 'x:５' is malformed, not a port).
    if rest and not (rest.startswith(":") and strict_json.ascii_digits(rest[1:], max_digits=5) is not None):
        return None
    return name


@dataclass(frozen=True)
class RequestGuard:
    """The per-request checks configured from Settings (immutable, shared by all requests)."""

    api_key: bytes | None
    allowed_hosts: frozenset[str] | None  # None: any Host
    require_key_off_loopback: bool

    @classmethod
    def from_settings(cls, settings: Settings) -> RequestGuard:
        allowed = parse_allowed_hosts(settings.allowed_hosts)
        if not settings.allowed_hosts.strip():
            allowed = LOOPBACK_HOST_NAMES if is_loopback_address(settings.host) else None
        return cls(api_key=settings.api_key.encode() if settings.api_key else None,
                   allowed_hosts=allowed,
                   require_key_off_loopback=not settings.allow_no_auth)

    def check_host(self, hosts: Sequence[str]) -> APIError | None:
        """Step 1: ``hosts`` are all Host header values of the request (one is valid)."""
        name = host_name(hosts[0]) if len(hosts) == 1 else None
        if name is None:
            return invalid_host(len(hosts))
        if self.allowed_hosts is not None and name not in self.allowed_hosts:
            return host_not_allowed()
        return None

    def check(self, *, method: str, path: str, authorization: str | None,
              content_type: str | None, local_address: str | None,
              route_matched: bool) -> APIError | None:
        """Steps 2 and 3 (after ``check_host``): the error for this request, or None.

        ``local_address`` is the server-side IP the connection arrived on (None: not an IP
        socket, e.g. a Unix socket, treated as local); ``route_matched`` is False for
        unknown routes and wrong methods, which keep their 404/405 (after the key check).
        """
        if path not in PUBLIC_PATHS:
            if self.api_key is not None:
                if not _bearer_matches(authorization, self.api_key):
                    return invalid_api_key()
            elif (self.require_key_off_loopback and local_address is not None
                    and not is_loopback_address(local_address)):
                return api_key_required()
        if route_matched and method == "POST" and not is_json_media_type(content_type):
            return unsupported_media_type(content_type)
        return None


def _bearer_matches(authorization: str | None, key: bytes) -> bool:
    scheme, _, token = (authorization or "").strip().partition(" ")
    # Compare even when the scheme is wrong, so timing does not tell which part failed.
    # Header values arrive decoded as latin-1; encoding back gives the bytes the client sent.
    provided = token.strip().encode("latin-1", "replace")
    return hmac.compare_digest(provided, key) and scheme.lower() == "bearer"


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json`` with any parameters (``; charset=utf-8``), case-insensitive."""
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


# -- the guards' errors (spec/README.md §3) --------------------------------------------

def invalid_api_key() -> APIError:
    """401 ``invalid_api_key``, with ``WWW-Authenticate: Bearer``."""
    return APIError(401, INVALID_REQUEST,
                    "Missing or incorrect API key: send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def api_key_required() -> APIError:
    """403 ``api_key_required``: a non-loopback connection to a server with no API key."""
    return APIError(403, INVALID_REQUEST,
                    "This server accepts connections from other machines but has no API key "
                    "configured, so it refuses them. Set TRIOSERVE_API_KEY on the server (or "
                    "TRIOSERVE_ALLOW_NO_AUTH=1 when a proxy in front authenticates clients).",
                    code="api_key_required")


def invalid_host(count: int) -> APIError:
    """400 ``invalid_host``: no Host header, several, or one that is not a host name."""
    what = "is missing" if count == 0 else "is repeated" if count > 1 else "is not a valid host name"
    return APIError(400, INVALID_REQUEST, f"The Host header {what}: send exactly one, "
                    f"naming the server (e.g. 'Host: localhost:8000').", code="invalid_host")


def host_not_allowed() -> APIError:
    """421 ``host_not_allowed``: the Host header names a host this server does not serve."""
    return APIError(421, INVALID_REQUEST,
                    "The Host header names a host this server does not answer for (a DNS "
                    "rebinding guard). Use the server's address, or add the name to "
                    "TRIOSERVE_ALLOWED_HOSTS on the server.",
                    code="host_not_allowed")


def unsupported_media_type(content_type: str | None) -> APIError:
    """415 ``unsupported_media_type``: a POST body that is not declared as JSON."""
    got = f"'{content_type[:100]}'" if content_type else "no Content-Type"
    return APIError(415, INVALID_REQUEST,
                    f"The request body must be JSON sent with 'Content-Type: application/json' "
                    f"(got {got}).", code="unsupported_media_type")


PROTOCOL_ERRORS = {
    400: ("invalid_http_request", "Malformed HTTP request."),
    408: ("request_timeout", "The request was not received in time (the connection sent it too "
                             "slowly); the connection is closed."),
    431: ("headers_too_large", "Request header fields too large."),
    501: ("not_implemented", "Unsupported HTTP feature (e.g. a transfer coding other than chunked)."),
    500: ("internal_error", "Internal server error while reading the request; the connection is "
                            "closed (details in the server log)."),
}


def protocol_error(status: int) -> APIError:
    """The envelope for an error found by the HTTP parser itself, before any route runs."""
    code, message = PROTOCOL_ERRORS.get(status, ("invalid_http_request", "Malformed HTTP request."))
    return APIError(status, SERVER_ERROR if status >= 500 and status != 501 else INVALID_REQUEST,
                    message, code=code)


def websocket_protocol_error(status: int) -> APIError:
    """The envelope for a WebSocket handshake the HTTP server refused before any route ran
    (400: not a valid handshake)."""
    if status == 400:
        return APIError(400, INVALID_REQUEST,
                        "Not a valid WebSocket handshake; this server does not accept WebSocket "
                        "connections anyway: send the request as plain HTTP.",
                        code="invalid_http_request")
    return protocol_error(status)


# -- ASGI layer ---------------------------------------------------------------------------

def json_bytes(obj: Any) -> bytes:
    """Compact JSON as UTF-8; text that cannot be UTF-8 (lone surrogates echoed from a
    request) is written as JSON escapes instead of failing."""
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode()


async def send_error(send: Any, error: APIError) -> None:
    """Answer an ASGI HTTP request with ``error``'s status, headers and envelope."""
    body = json_bytes(error.envelope())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# A close code for servers without the websocket.http.response extension: 1008 "policy
# violation" (RFC 6455 §7.4.1), the generic "refused"; they answer a close before accept
# with HTTP 403 anyway.
_POLICY_VIOLATION = 1008


async def send_websocket_error(scope: dict, send: Any, error: APIError,
                               body_for: Callable[[APIError, str], Any] | None = None) -> None:
    """Refuse a websocket ``scope`` with ``error``: an HTTP response with its status, headers
    and JSON body (``body_for(error, path)``, default the OpenAI envelope) where the server
    supports ``websocket.http.response``, else a close before accept."""
    if "websocket.http.response" not in (scope.get("extensions") or {}):
        await send({"type": "websocket.close", "code": _POLICY_VIOLATION,
                    "reason": (error.code or "refused")[:100]})
        return
    body = json_bytes(body_for(error, scope.get("path", "")) if body_for else error.envelope())
    # No connection-specific headers: the handshake may be an HTTP/2 extended CONNECT.
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1"))
                for name, value in error.headers.items() if name.lower() != "connection"]
    await send({"type": "websocket.http.response.start", "status": error.status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body, "more_body": False})


class HostCheck:
    """ASGI middleware in front of Quart: refuse a request whose Host (or absolute-form
    target authority) fails ``RequestGuard.check_host``, and one whose framing is
    ambiguous (:func:`framing_error`).

    An absolute-form target (``POST http://evil.example/v1/chat/completions``) names the
    host the client means; RFC 9112 §3.2.2 makes it override Host, so it is checked like
    Host and, when allowed, routed by its path alone.
    """

    def __init__(self, app: Any, guard: RequestGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            # A WebSocket handshake passes the same Host check (spec §17.1); what follows is
            # refused by trioserve.http.websocket.
            hosts = [value.decode("latin-1") for name, value in scope.get("headers") or ()
                     if name.lower() == b"host"]
            error = self.guard.check_host(hosts)
            if error is not None:
                return await send_websocket_error(scope, send, error)
        elif scope["type"] == "http":
            headers = scope.get("headers") or ()
            error = framing_error(headers)
            if error is None:
                hosts = [value.decode("latin-1") for name, value in headers if name.lower() == b"host"]
                error = self.guard.check_host(hosts)
            if error is None:
                authority, path = split_absolute_form(scope.get("raw_path") or b"")
                if authority is not None:
                    error = self.guard.check_host([authority])
                    if error is None:
                        scope = {**scope, "raw_path": path, "path": unquote(path.decode("latin-1"))}
            if error is not None:
                return await send_error(send, error)
        return await self.app(scope, receive, send)


def split_absolute_form(raw_path: bytes) -> tuple[str | None, bytes]:
    """``b"http://h:1/v1/x"`` → ``("h:1", b"/v1/x")``; an origin-form path → ``(None, path)``.

    (``raw_path`` is the request target without its query, as hypercorn passes it.)
    """
    scheme, sep, rest = raw_path.partition(b"://")
    if not sep or not scheme or not scheme.isalpha() or raw_path.startswith(b"/"):
        return None, raw_path
    authority, slash, path = rest.partition(b"/")
    return authority.decode("latin-1"), slash + path if slash else b"/"


def framing_error(headers: Sequence[tuple[bytes, bytes]]) -> APIError | None:
    """400 ``invalid_http_request`` (with ``Connection: close``) for a request that has both
    Content-Length and Transfer-Encoding. h11 frames it by Transfer-Encoding, a proxy in
    front may have used Content-Length: the bytes after the body could be a request
    smuggled past the proxy, so the connection is closed after the answer instead of
    reading them (RFC 9112 §6.3)."""
    names = {name.lower() for name, _ in headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        return APIError(400, INVALID_REQUEST,
                        "The request has both Content-Length and Transfer-Encoding: send one. "
                        "The connection is closed.",
                        code="invalid_http_request", headers={"Connection": "close"})
    return None
