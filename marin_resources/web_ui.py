"""The local web UI with a same-origin guard: `marin ui`.

Dagster's webserver has no sign-in, and its GraphQL endpoint executes a mutation from any request
that reaches it: a `text/plain` POST (which a web page may send to another origin without asking)
with the mutation in its query string, or a GET. Binding to 127.0.0.1 keeps other machines out, not
the pages open in the developer's browser, which reach 127.0.0.1 too. `SameOriginGuard` sits in front
of the webserver's ASGI app and lets through only what the UI's own pages, or a client outside any
browser (curl, dagster-graphql), send:

- the Host header names this server (127.0.0.1, localhost, ::1 or the host it binds): a page whose
  domain was rebound to 127.0.0.1 reads and writes nothing;
- a write (any method but GET, HEAD, OPTIONS) or a WebSocket handshake comes from this origin: an
  `Origin` header, where the browser sends one, names this scheme, host and port, and
  `Sec-Fetch-Site`, where it sends that, says `same-origin` (or `none`: typed by the user);
- a write never carries a body type a page may send cross-site without a CORS preflight
  (`text/plain`, form data), and a POST to `/graphql` is `application/json`;
- a GET to `/graphql` holds no mutation.

Refusals are a 403 (415 for the body type, 405 for a mutation by GET) with one line saying why.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# The body types a page may POST to any origin without a CORS preflight (the Fetch standard's
# CORS-safelisted request headers): the ones a cross-site form or `fetch(..., {mode: "no-cors"})` sends.
CROSS_SITE_BODY_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
SAME_ORIGIN_FETCH_SITES = frozenset({"same-origin", "none"})


def host_name(host_header: str) -> str:
    """The name in a Host header or an origin's authority, without the port ("[::1]:3000" -> "::1")."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def is_mutation(query: str) -> bool:
    """Whether a GraphQL document holds a mutation (an unparsable one is left to the server to refuse)."""
    from graphql import GraphQLError, OperationDefinitionNode, OperationType, parse

    try:
        document = parse(query)
    except GraphQLError:
        return False
    return any(isinstance(d, OperationDefinitionNode) and d.operation == OperationType.MUTATION
               for d in document.definitions)


def refusal(*, kind: str, method: str, path: str, query_string: str, headers: Mapping[str, str],
            allowed_hosts: Iterable[str]) -> tuple[int, str] | None:
    """(status, reason) for a request the guard refuses, None for one it lets through. ``kind`` is the
    ASGI scope type ("http" or "websocket"), ``headers`` lower-cased names."""
    host = headers.get("host", "")
    if host_name(host).lower() not in {h.lower() for h in allowed_hosts}:
        return 403, f"host {host!r} is not this server's (allowed: {', '.join(sorted(allowed_hosts))})"
    writes = kind == "websocket" or method not in SAFE_METHODS
    graphql = path.rstrip("/").endswith("/graphql")
    if writes:
        origin = headers.get("origin")
        if origin is not None and urlsplit(origin).netloc.lower() != host.lower():
            return 403, f"cross-origin request from {origin!r} refused: the UI takes writes only from its own pages"
        site = headers.get("sec-fetch-site")
        if site is not None and site not in SAME_ORIGIN_FETCH_SITES:
            return 403, f"request from a {site} page refused: the UI takes writes only from its own pages"
    if kind == "http" and method not in SAFE_METHODS:
        body_type = media_type(headers.get("content-type", ""))
        if body_type in CROSS_SITE_BODY_TYPES or (graphql and body_type != "application/json"):
            return 415, f"{body_type or 'no'} body refused: writes to this UI are application/json"
    if kind == "http" and method == "GET" and graphql:
        queries = parse_qs(query_string).get("query", [])
        if any(is_mutation(q) for q in queries):
            return 405, "a GraphQL mutation by GET refused: send it as an application/json POST"
    return None


class SameOriginGuard:
    """ASGI middleware: ``app`` behind `refusal`'s rules, for the host names in ``allowed_hosts``."""

    def __init__(self, app: Any, allowed_hosts: Iterable[str]):
        self.app = app
        self.allowed_hosts = frozenset(allowed_hosts)

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refused = refusal(kind=scope["type"], method=scope.get("method", "GET"), path=scope.get("path", ""),
                          query_string=scope.get("query_string", b"").decode("latin-1"), headers=headers,
                          allowed_hosts=self.allowed_hosts)
        if refused is None:
            return await self.app(scope, receive, send)
        status, reason = refused
        if scope["type"] == "websocket":
            # Closing before accepting refuses the handshake (the server answers 403).
            await send({"type": "websocket.close", "code": 1008, "reason": reason[:120]})
            return None
        body = f"marin ui: {reason}\n".encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return None


def allowed_hosts_for(host: str) -> frozenset[str]:
    """The names the UI answers to when bound to ``host``: loopback's, and ``host`` itself unless it
    is a wildcard address (which names no host a browser would use)."""
    return LOOPBACK_HOSTS | ({host} if host not in ("0.0.0.0", "::", "") else set())


def start_daemon(workspace: Path) -> subprocess.Popen:
    """`dagster-daemon run` on ``workspace`` (the instance of DAGSTER_HOME): what `dagster dev` starts beside
    its webserver, for schedules, sensors, automation and the run queue."""
    daemon = Path(sys.executable).with_name("dagster-daemon")
    return subprocess.Popen([str(daemon), "run", "-w", str(workspace)], env=os.environ.copy())


def stop(process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def serve(instance, workspace: Path, *, host: str, port: int, extra_hosts: Iterable[str] = (),
          daemon: bool = True) -> None:
    """The guarded web UI of ``workspace`` and ``instance`` (DAGSTER_HOME's) on ``host``:``port`` until SIGINT
    or SIGTERM, and, with ``daemon``, `dagster-daemon` beside it (stopped when the UI stops)."""
    import uvicorn

    from marin_resources.dagster_private import webserver_app

    with contextlib.ExitStack() as stack:
        if daemon:
            stack.callback(stop, start_daemon(workspace))
        stack.callback(instance.dispose)
        app = webserver_app(stack, instance, str(workspace))
        guarded = SameOriginGuard(app, allowed_hosts_for(host) | set(extra_hosts))
        print(f"marin ui: serving the web UI on http://{host_for_url(host)}:{port} (same-origin writes only; "
              "docs/ui.md)", flush=True)
        # uvicorn shuts down on SIGINT or SIGTERM, then raises the signal again with the handlers it found:
        # this one makes SIGTERM, like SIGINT, end in an exception, so the stack stops the code servers
        # and the daemon instead of the process dying with them still running.
        signal.signal(signal.SIGTERM, interrupt)
        with contextlib.suppress(KeyboardInterrupt):
            uvicorn.run(guarded, host=host, port=port, log_level="warning")


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host

