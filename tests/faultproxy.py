"""A loopback HTTP server for fault tests: serves a folder (GET with Range, HEAD) or
forwards to an upstream server (moto's S3), injecting faults into chosen GETs.

    with FaultProxy(root=folder) as proxy:          # or FaultProxy(upstream=s3.endpoint)
        proxy.fail("shard-00002", "truncate")       # the next GET of that path
        proxy.fail("shard-00003", "corrupt", times=None)   # every GET of it
        proxy.fail("shard-00003", "corrupt", at=1 << 20)   # the next GET of bytes from 1 MiB
        url = proxy.url + "/archive"
        proxy.gets["shard-00002"]                    # GETs whose path held that text
        proxy.sent_bytes("shard-")                    # body bytes sent for such paths

A client in another process reads the bytes sent so far, as JSON {path: bytes}, from
``proxy.url + "/.faultproxy-sent"``.

Faults: ``drop`` (close the connection without a response), ``slowdown`` (503
with S3's SlowDown body), ``truncate`` (the full Content-Length announced,
half the body sent, connection closed), ``corrupt`` (one byte flipped),
``stall`` (half the body sent, then the connection held open until the
proxy closes), ``hold`` (the answer held back until ``proxy.let_through()``,
then sent whole), ``hang`` (the request read, nothing ever answered until the
proxy closes; HEAD requests too): ``proxy.fail("", "hang", times=None)`` makes
a server that accepts connections and never answers; ``forbidden`` (403, as a
refused credential), ``norange`` (the whole object with 200, as a server that
ignores Range).

``proxy.swap("unit-000000-0000", "unit-000000-0001")`` answers every request
(GET and HEAD) for a path holding the first text as if it named the second, as
an object replaced in place would be, until ``proxy.swap()`` ends it.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SENT_PATH = "/.faultproxy-sent"
SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultProxy:
    def __init__(self, root: Path | None = None, upstream: str | None = None) -> None:
        self.root = root
        self.upstream = urlsplit(upstream) if upstream else None
        self.faults: list[list[Any]] = []  # [match, kind, times left or None]
        self.gets: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()  # body bytes written per path
        self.wasted: Counter[str] = Counter()  # of those, bytes sent under a fault
        self.ranges: list[str] = []
        self.ranged: list[tuple[str, str]] = []  # (path, Range) of each ranged GET
        self.asked: list[tuple[str, str]] = []  # (path, Range) of each GET, faults and all
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.through = threading.Event()  # held answers go on
        self.swapped: tuple[str, str] | None = None  # (text in a path, what answers for it)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.server.daemon_threads = True
        host, port = self.server.server_address[:2]
        self.url = f"http://{host}:{port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def fail(self, match: str, kind: str, times: int | None = 1, at: int | None = None) -> None:
        """``kind`` for the next ``times`` requests (None: all) whose path holds ``match``,
        or is exactly what follows ``=`` in it (``=/bucket``: the bucket's listings), and
        with ``at``, whose Range starts at that byte."""
        with self.lock:
            self.faults.append([match, kind, times, at])

    def let_through(self) -> None:
        """Sends the answers held back (``hold``), and those held from now on."""
        self.through.set()

    def swap(self, match: str = "", to: str = "") -> None:
        """Answers requests for paths holding ``match`` as if they held ``to`` instead
        (no arguments: as they are again)."""
        with self.lock:
            self.swapped = (match, to) if match else None

    def routed(self, path: str) -> str:
        """``path`` as the swap in force answers it."""
        with self.lock:
            swapped = self.swapped
        if swapped is not None and swapped[0] in path:
            return path.replace(swapped[0], swapped[1])
        return path

    def sent_bytes(self, match: str = "") -> int:
        with self.lock:
            return sum(n for path, n in self.sent.items() if match in path)

    def count(self, match: str) -> int:
        with self.lock:
            return sum(n for path, n in self.gets.items() if match in path)

    def take_fault(self, path: str, head: bool = False, start: int | None = None) -> str | None:
        """The fault for this request, if any (a HEAD request takes only ``hang``);
        ``start``: where its Range starts."""
        with self.lock:
            if not head:
                self.gets[path] += 1
            for f in self.faults:
                if head and f[1] != "hang":
                    continue
                hit = path == f[0][1:] if f[0].startswith("=") else f[0] in path
                hit = hit and (f[3] is None or f[3] == start)
                if hit and (f[2] is None or f[2] > 0):
                    if f[2] is not None:
                        f[2] -= 1
                    return str(f[1])
        return None

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        self.through.set()
        self.server.shutdown()
        self.server.server_close()

    def fetch(self, handler: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        """The response the fault-free server gives: from the folder or the upstream."""
        if self.upstream is not None:
            conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port)
            length = int(handler.headers.get("Content-Length") or 0)
            body = handler.rfile.read(length) if length else None
            conn.request(handler.command, self.routed(handler.path), body, dict(handler.headers))
            resp = conn.getresponse()
            data = resp.read()
            headers = {k: v for k, v in resp.getheaders() if k.lower() != "transfer-encoding"}
            conn.close()
            return resp.status, headers, data
        return self.serve_file(handler)

    def serve_file(self, handler: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        assert self.root is not None
        path = self.root / urlsplit(self.routed(handler.path)).path.lstrip("/")
        if not path.is_file():
            return 404, {"Content-Type": "text/plain"}, b"not found"
        data = path.read_bytes()
        total = len(data)
        headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        rng = handler.headers.get("Range")
        if rng and rng.startswith("bytes="):
            self.ranges.append(rng)
            self.ranged.append((urlsplit(handler.path).path, rng))
            first, _, last = rng[6:].partition("-")
            start = int(first) if first else total - int(last)
            stop = min(total, int(last) + 1) if first and last else total
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{total}"
            return 206, headers, data[start:stop]
        return 200, headers, data

    def handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def respond(self, status: int, headers: dict[str, str], length: int) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in ("content-length", "connection", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(length))
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True

            def do_HEAD(self) -> None:
                if proxy.take_fault(urlsplit(self.path).path, head=True) == "hang":
                    proxy.closing.wait()
                    return
                status, headers, body = proxy.fetch(self)
                # the length, not the body: an upstream's HEAD says it in its header
                length = {k.lower(): v for k, v in headers.items()}.get("content-length")
                self.respond(status, headers, int(length) if length else len(body))

            def send_body(self, body: bytes, fault: str | None = None) -> None:
                self.wfile.write(body)
                with proxy.lock:
                    proxy.sent[urlsplit(self.path).path] += len(body)
                    if fault is not None:
                        proxy.wasted[urlsplit(self.path).path] += len(body)

            def do_GET(self) -> None:
                if urlsplit(self.path).path == SENT_PATH:
                    with proxy.lock:
                        report = json.dumps(dict(proxy.sent)).encode()
                    self.respond(200, {"Content-Type": "application/json"}, len(report))
                    self.wfile.write(report)
                    return
                rng = self.headers.get("Range") or ""
                with proxy.lock:
                    proxy.asked.append((urlsplit(self.path).path, rng))
                first = rng[6:].partition("-")[0] if rng.startswith("bytes=") else ""
                start = int(first) if first.isdigit() else None
                fault = proxy.take_fault(urlsplit(self.path).path, start=start)
                if fault == "hold":
                    while not (proxy.through.wait(0.05) or proxy.closing.is_set()):
                        pass
                    fault = None
                if fault == "hang":
                    proxy.closing.wait()
                    return
                if fault == "drop":
                    self.close_connection = True
                    return
                if fault == "forbidden":
                    body = b"<Error><Code>AccessDenied</Code></Error>"
                    self.respond(403, {"Content-Type": "application/xml"}, len(body))
                    self.wfile.write(body)
                    return
                if fault == "norange":
                    del self.headers["Range"]
                    fault = None
                if fault == "slowdown":
                    self.respond(503, {"Content-Type": "application/xml"}, len(SLOWDOWN))
                    self.wfile.write(SLOWDOWN)
                    return
                status, headers, body = proxy.fetch(self)
                if fault == "corrupt" and status < 300 and body:
                    mid = len(body) // 2
                    body = body[:mid] + bytes([body[mid] ^ 0xFF]) + body[mid + 1 :]
                if fault in ("truncate", "stall") and status < 300:
                    self.respond(status, headers, len(body))  # announces the full length
                    self.send_body(body[: len(body) // 2], fault)
                    self.wfile.flush()
                    if fault == "stall":
                        proxy.closing.wait()
                    return
                self.respond(status, headers, len(body))
                self.send_body(body, fault)

        return Handler
