"""A real HTTP mirror on 127.0.0.1 (http.server in a thread) serving a folder, for the data tests.

It honours ``Range: bytes=N-`` (206) and can misbehave on purpose:
- ``truncate``: the first response for each path promises the whole file and sends half of it,
  then closes the connection (the client must resume from what it got);
- ``hang``: accept the request and never answer (the client must time out);
- ``corrupt``: serve the file with one byte changed (the checksum must refuse it);
- ``endless``: send the file and then zeros, without a Content-Length, until the client hangs up
  (or 64 MiB, so that a client without a cap fails a test instead of filling the disk); the
  client must stop at the file's pinned size; ``oversize`` the same with a Content-Length 1,000
  times the file's (the client must refuse it before reading the body);
- ``drip``: promise the whole file, then send one byte every ``drip_s`` seconds, for at most 10 s
  (a per-read timeout never fires: only a total deadline stops the client).

`sent` counts the body bytes the server wrote, over all requests.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote


class MirrorServer:
    """A running mirror: `url` is its base; `requests` logs (path, Range header) of each GET."""

    def __init__(self, root: Path, mode: str = "ok", *, drip_s: float = 0.2):
        self.root, self.mode, self.drip_s = Path(root), mode, drip_s
        self.sent = 0
        self.requests: list[tuple[str, str | None]] = []
        self.truncated: set[str] = set()
        self.stop = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "MirrorServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(server: MirrorServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            rel = unquote(self.path.split("?", 1)[0]).lstrip("/")
            server.requests.append((rel, self.headers.get("Range")))
            if server.mode == "hang":
                server.stop.wait(60)
                return
            path = (server.root / rel).resolve()
            if ".." in Path(rel).parts or not path.is_file():
                self.send_error(404)
                return
            data = path.read_bytes()
            if server.mode == "corrupt":
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            start = _range_start(self.headers.get("Range"))
            if start is not None and start >= len(data):
                self.send_error(416)
                return
            body = data[start or 0:]
            if server.mode in ("endless", "oversize", "drip"):
                self._misbehave(body)
                return
            self.send_response(206 if start else 200)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if server.mode == "truncate" and rel not in server.truncated:
                server.truncated.add(rel)
                body = body[:len(body) // 2]
                self.close_connection = True
            self.wfile.write(body)
            server.sent += len(body)

        def _misbehave(self, body: bytes) -> None:
            self.send_response(200)
            self.close_connection = True
            if server.mode == "oversize":
                self.send_header("Content-Length", str(1000 * len(body)))
            elif server.mode == "drip":
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                if server.mode == "drip":
                    for i in range(min(len(body), int(10 / server.drip_s))):
                        if server.stop.wait(server.drip_s):
                            return
                        self.wfile.write(body[i:i + 1])
                        self.wfile.flush()
                        server.sent += 1
                    return
                self.wfile.write(body)
                server.sent += len(body)
                zeros = bytes(1 << 16)
                while not server.stop.is_set() and server.sent < 64 << 20:  # until the client hangs up
                    self.wfile.write(zeros)
                    server.sent += len(zeros)
            except OSError:  # the client closed the connection: what a bounded client does
                pass

    return Handler


def _range_start(header: str | None) -> int | None:
    if not header or not header.startswith("bytes=") or not header.endswith("-"):
        return None
    value = header[6:-1]
    return int(value) if value.isdigit() else None
