"""Misbehaving Hubs for the registry's fault tests, on 127.0.0.1 (no patching of any client).

- ``silent_endpoint()``: a port that accepts connections (the kernel completes them from the
  listen backlog) and never answers a byte, as a stalled server or proxy does.
- ``FaultyHub(upstream)``: a proxy in front of the test Hub (tests/hub_servers.py) that forwards
  every request, except those a rule matches: a rule answers a fixed HTTP status, or rewrites
  the JSON of the Hub's answer (``sha: "main"``, say). ``rules`` is a list the test edits.

    with FaultyHub(hub.endpoint) as faulty:
        faulty.rules.append(Rule("POST", r"/api/models/.*/tag/.*", status=409))
        push_pack(pack, repo_id, tag="v1")  # with HF_ENDPOINT=faulty.url
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from .hub_write_server import send_relayed


@contextlib.contextmanager
def silent_endpoint() -> Iterator[str]:
    """The URL of a port that accepts connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)  # never accepted: connections wait in the backlog, unanswered
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@dataclass
class Rule:
    """Requests whose method and path (without the query) match: answered ``status`` (with the
    Hub's JSON error body), or forwarded and their JSON answer passed through ``rewrite``."""

    method: str  # a regular expression, e.g. "GET|HEAD"
    path: str  # a regular expression over the whole path
    status: int | None = None
    rewrite: Callable[[object], object] | None = None
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        return bool(re.fullmatch(self.method, method) and re.fullmatch(self.path, path))


class FaultyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FaultyHub

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = urlsplit(self.path).path
        rule = next((r for r in self.server.rules if r.matches(self.command, path)), None)
        if rule is not None:
            rule.hits += 1
        if rule is not None and rule.status is not None:
            message = f"injected HTTP {rule.status}"
            return self.send(rule.status, [("X-Error-Message", message)], b"")
        status, headers, data = self.forward(body)
        if rule is not None and rule.rewrite is not None and status == 200:
            data = json.dumps(rule.rewrite(json.loads(data))).encode()
        self.send(status, headers, data)

    do_HEAD = do_POST = do_DELETE = do_PUT = do_GET

    def forward(self, body: bytes) -> tuple[int, list, bytes]:
        connection = http.client.HTTPConnection(*self.server.upstream, timeout=60)
        skip = {"host", "connection", "keep-alive", "transfer-encoding", "content-length"}
        headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
        try:
            connection.request(self.command, self.path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def send(self, status: int, headers: list, data: bytes) -> None:
        if status >= 400 and not data:
            data = json.dumps({"error": f"injected HTTP {status}"}).encode()
            headers = [*headers, ("Content-Type", "application/json")]
        send_relayed(self, status, headers, data)


class FaultyHub(ThreadingHTTPServer):
    """A proxy on 127.0.0.1 in front of ``upstream`` (a URL), breaking what ``rules`` say."""

    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), FaultyHandler)
        host, port = urlsplit(upstream).netloc.split(":")
        self.upstream = (host, int(port))
        self.rules: list[Rule] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> FaultyHub:
        threading.Thread(target=self.serve_forever, daemon=True, name="faulty-hub").start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()
