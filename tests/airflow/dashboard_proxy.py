"""A fault-injecting HTTP proxy in front of the Ray dashboard (threaded, 127.0.0.1), for the retry tests.

``fail_next(n)`` makes the next ``n`` requests fail, alternating a connection reset
and an HTTP 503, before anything reaches the dashboard; ``down = True`` fails every
request (an outage). Other requests are forwarded with their headers (the token).
"""
from __future__ import annotations

import http.client
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade", "content-length"}


class DashboardProxy:
    def __init__(self, upstream: str):
        self.upstream = urlparse(upstream)
        self.lock = threading.Lock()
        self.to_fail = 0
        self.down = False
        self.injected: dict[str, int] = {"reset": 0, "503": 0}
        self.forwarded = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                fault = proxy.decide()
                if fault == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return
                if fault == "503":
                    self._reply(503, b"Service Unavailable (injected)", [("Content-Type", "text/plain")])
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                if body or self.command in ("POST", "PUT"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self._reply(resp.status, data, [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP])

            def _reply(self, status: int, data: bytes, headers: list[tuple[str, str]]) -> None:
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def fail_next(self, n: int) -> None:
        with self.lock:
            self.to_fail = n

    def decide(self) -> str | None:
        with self.lock:
            if not self.down and self.to_fail <= 0:
                self.forwarded += 1
                return None
            self.to_fail -= 1
            fault = "reset" if sum(self.injected.values()) % 2 == 0 else "503"
            self.injected[fault] += 1
            return fault

    def __enter__(self) -> DashboardProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
