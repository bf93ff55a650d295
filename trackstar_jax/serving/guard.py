"""The explorer's request guard: one ASGI middleware in front of every route.

The explorer has no authentication; it is safe on loopback only if a web page the user
visits cannot reach it. The guard refuses (JSON `{"error": message}`, nothing of the app
runs):

- a `Host` not in the allow-list (400): a DNS-rebinding page reaches 127.0.0.1 under its
  own name (`evil.example.com:8765`), and would otherwise read `/api/file` and run queries;
- a request whose `Origin` is not this server (403), and an API request or a state-changing
  one that the browser marks cross-site or same-site (`Sec-Fetch-Site`, 403): cross-origin
  reads and CSRF;
- a state-changing request (not GET / HEAD / OPTIONS) whose body is not `application/json`
  (415): a cross-origin `text/plain` form or fetch needs no CORS preflight, JSON does;
- a body over `max_body_bytes` (413): `Content-Length` is checked before reading, and the
  bytes are counted as they arrive (chunked bodies), so no more than the limit is held;
- any websocket handshake (the explorer has no websocket route).

Every response gets `X-Content-Type-Options: nosniff`, `Referrer-Policy: no-referrer` and a
Content-Security-Policy (`page_csp`: only the page's own inline script runs, no inline
event handler, images from this server only (the evaluation plots), no frame / form / remote
fetch), so markup that slips into the page still cannot run script.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import urllib.parse
from typing import Iterable

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SAME_ORIGIN_FETCH = frozenset({"same-origin", "none"})  # Sec-Fetch-Site values of the page itself / a typed URL
_SCRIPT = re.compile(rb"<script\b[^>]*>(.*?)</script>", re.S | re.I)


class _BodyTooLarge(Exception):
    pass


def split_host(host: str) -> tuple[str, str]:
    """`(name, port)` of a Host header / netloc: `"[::1]:8765"` -> `("::1", "8765")`, the name
    lowercased without a trailing dot, port "" when absent; a bare IPv6 address (`"::1"`) is
    all name. ValueError when malformed (spaces, userinfo, a path, an empty name)."""
    host = host.strip().lower()
    if host.count(":") > 1 and not host.startswith("["):
        host = f"[{host}]"
    m = re.fullmatch(r"\[([0-9a-f:.]+)\](?::([0-9]{1,5}))?|([^:\[\]/@\s]+)(?::([0-9]{1,5}))?", host)
    if not m or not (m.group(1) or m.group(3)).rstrip("."):
        raise ValueError(f"malformed host {host!r}")
    return (m.group(1) or m.group(3)).rstrip("."), m.group(2) or m.group(4) or ""


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """Host names the server answers to: loopback, the bound address (unless a wildcard
    such as 0.0.0.0 / ::) and `extra` (names of the machine on another interface).

    Raises:
      ValueError: an `extra` entry that is not a bare host name or address (names it).
    """
    names = [
        split_host(h)[0] for h in LOOPBACK_HOSTS + ((bind_host,) if bind_host not in ("0.0.0.0", "::", "") else ())
    ]
    for h in extra:
        try:
            name, port = split_host(h)
        except ValueError:
            name, port = "", ""
        if not name or port:
            raise ValueError(f"allowed host {h!r}: give a host name or address without a port")
        names.append(name)
    return tuple(dict.fromkeys(names))


def page_csp(html: bytes) -> str:
    """The Content-Security-Policy of the page `html`: its inline <script> blocks (by hash)
    are the only script; styles inline; fetches and images (the evaluation plots) from this
    origin only; nothing else loads."""
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(s).digest()).decode() + "'" for s in _SCRIPT.findall(html)
    )
    return (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


class Guard:
    """ASGI middleware applying the module docstring's checks to `app`.

    Args:
      app: the ASGI app guarded.
      hosts: allowed Host names (`allowed_hosts`), any port.
      max_body_bytes: the largest request body accepted.
      csp: the Content-Security-Policy header value of every response.
    """

    def __init__(self, app, *, hosts: Iterable[str], max_body_bytes: int, csp: str):
        self.app, self.hosts, self.max_body_bytes = app, frozenset(hosts), max_body_bytes
        self.extra_headers = [
            (b"x-content-type-options", b"nosniff"),
            (b"referrer-policy", b"no-referrer"),
            (b"content-security-policy", csp.encode()),
        ]

    def refusal(self, scope: dict) -> tuple[int, str] | None:
        """`(status, message)` when the request is refused before the app sees it, else None."""
        headers = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        host = headers.get("host", "")
        try:
            name = split_host(host)[0]
        except ValueError:
            name = None
        if name not in self.hosts:
            return 400, (
                f"Host {host!r} is not served (allowed: {sorted(self.hosts)}); a server bound to another "
                "interface lists its names in launch.serve --allowed_hosts"
            )
        origin = headers.get("origin")
        if origin is not None:
            o = urllib.parse.urlsplit(origin)
            if o.scheme not in ("http", "https") or o.netloc.lower() != host.strip().lower():
                return 403, f"cross-origin request from {origin!r} refused"
        method, path = scope["method"], scope["path"]
        site = headers.get("sec-fetch-site")
        if (
            site is not None
            and site not in SAME_ORIGIN_FETCH
            and (method not in SAFE_METHODS or path.startswith("/api/"))
        ):
            return 403, f"{site} request refused (only this page may call the API)"
        if method not in SAFE_METHODS:
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return 415, f"{method} body must be application/json, got {media or 'no content type'!r}"
        length = headers.get("content-length")
        if length is not None:
            if not length.isascii() or not length.isdigit():
                return 400, f"malformed Content-Length {length!r}"
            if int(length) > self.max_body_bytes:
                return 413, f"request body of {int(length)} bytes exceeds {self.max_body_bytes}"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":  # the explorer has none: refuse the handshake (uvicorn answers 403)
            return await send({"type": "websocket.close", "code": 1008})
        if scope["type"] != "http":  # lifespan
            return await self.app(scope, receive, send)
        started = False

        async def send_with_headers(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": list(message.get("headers", [])) + self.extra_headers}
            await send(message)

        async def error(status: int, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            if status == 413:  # the rest of the body is never read: end the connection
                headers.append((b"connection", b"close"))
            await send_with_headers({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        refused = self.refusal(scope)
        if refused is not None:
            return await error(*refused)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counted_receive, send_with_headers)
        except _BodyTooLarge:
            if started:
                raise
            await error(413, f"request body exceeds {self.max_body_bytes} bytes")
