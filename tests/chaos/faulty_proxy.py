"""A fault-injecting HTTP proxy for S3 (threaded, 127.0.0.1), placed in front of the moto server.

At seeded random points it answers 500 InternalError, 503 SlowDown or
ServiceUnavailable, or resets the connection, always *before* forwarding the
request, so the server never half-applies it. The first UploadPart requests
of multipart uploads are always failed, so a multipart upload is interrupted.
"""
from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

ERRORS = [
    (500, "InternalError", "We encountered an internal error. Please try again."),
    (503, "SlowDown", "Please reduce your request rate."),
    (503, "ServiceUnavailable", "Service is unable to handle request."),
]
HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


class FaultyProxy:
    def __init__(self, upstream: str, seed: int, rate: float = 0.04, multipart_faults: int = 2):
        self.upstream = urlparse(upstream)
        self.rng = random.Random(seed)
        self.rate = rate
        self.multipart_left = multipart_faults
        self.lock = threading.Lock()
        self.injected: dict[str, int] = {}
        self.requests = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", ""):
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

            def _handle(self):
                body = self._body()
                fault = proxy.decide(self.command, self.path)
                if fault == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return
                if fault is not None:
                    status, code, message = fault
                    payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                               f"<Message>{message}</Message></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in HOP and k.lower() != "content-length"}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                head = self.command == "HEAD"  # no body: its Content-Length is the object's size, passed on as is
                for key, value in resp.getheaders():
                    if key.lower() not in HOP and (key.lower() != "content-length" or head):
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def decide(self, method: str, path: str):
        with self.lock:
            self.requests += 1
            if method == "PUT" and "partNumber=" in path and self.multipart_left > 0:
                self.multipart_left -= 1
                return self._count(self.rng.choice(ERRORS + ["reset"]), "multipart")
            if self.rng.random() < self.rate:
                return self._count(self.rng.choice(ERRORS + ["reset"]))
            return None

    def _count(self, fault, extra: str | None = None):
        name = "reset" if fault == "reset" else fault[1]
        self.injected[name] = self.injected.get(name, 0) + 1
        if extra:
            self.injected[extra] = self.injected.get(extra, 0) + 1
        return fault

    def __enter__(self) -> FaultyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
