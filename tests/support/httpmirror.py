"""A real HTTP mirror on 127.0.0.1 (http.server in a thread) serving a folder, for the data tests.

It honours ``Range: bytes=N-`` (206) and can misbehave on purpose:
- ``truncate``: the first response for each path promises the whole file and sends half of it,
  then closes the connection (the client must resume from what it got);
- ``hang``: accept the request and never answer (the client must time out);
- ``corrupt``: serve the file with one byte changed (the checksum must refuse it).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote


class MirrorServer:
    """A running mirror: `url` is its base; `requests` logs (path, Range header) of each GET."""

    def __init__(self, root: Path, mode: str = "ok"):
        self.root, self.mode = Path(root), mode
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

    return Handler


def _range_start(header: str | None) -> int | None:
    if not header or not header.startswith("bytes=") or not header.endswith("-"):
        return None
    value = header[6:-1]
    return int(value) if value.isdigit() else None
