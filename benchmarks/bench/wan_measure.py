"""Measure an emulated link with a plain TCP client: RTT by 1-byte pings, goodput by bulk transfers.

`SinkServer` is a real TCP server (threads, blocking sockets) that logs when bytes arrive, so a
caller can see throughput over time (a scheduled step, an outage). `python -m
geofed.bench.wan_measure` prints the accuracy table of docs/wan.md.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import statistics
import struct
import threading
import time
from collections.abc import Sequence

PING, BULK, DONE = b"p", b"b", b"d"
IO_TIMEOUT_S = 60.0
PATTERN = bytes(range(256)) * 4096      # 1 MiB; bulk() sends it over and over


def pattern_digest(nbytes: int) -> str:
    """sha256 of what bulk(sock, nbytes) sends: a receiver that got these bytes in order matches it."""
    h = hashlib.sha256()
    view = memoryview(PATTERN)
    while nbytes:
        k = min(nbytes, len(view))
        h.update(view[:k])
        nbytes -= k
    return h.hexdigest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise ConnectionError(f"peer closed after {len(out)} of {n} bytes")
        out += part
    return bytes(out)


class SinkServer:
    """TCP server on `host`: 'p' -> echoes 'p'; 'b' + u64 n + n bytes -> replies 'd' once all arrived.

    `arrivals[i]` lists (monotonic time, bytes so far) of the i-th bulk transfer, one entry per
    recv; `digests[i]` is the sha256 of its bytes, once complete.
    """

    def __init__(self, host: str = "127.0.0.1", *, sock: socket.socket | None = None):
        # `sock`: an unbound socket made elsewhere (in another network namespace, for kernel mode).
        self.sock = sock if sock is not None else socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)   # lets the accept loop notice close()
        self.port = self.sock.getsockname()[1]
        self.address = f"{host}:{self.port}"
        self.arrivals: list[list[tuple[float, int]]] = []
        self.digests: list[str] = []
        self.errors: list[BaseException] = []
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="wan-sink", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(1 << 20)
        try:
            while True:
                op = conn.recv(1)
                if not op:
                    return
                if op == PING:
                    conn.sendall(PING)
                    continue
                assert op == BULK, f"sink: unknown op {op!r}"
                (n,) = struct.unpack("!Q", _recv_exact(conn, 8))
                log: list[tuple[float, int]] = []
                self.arrivals.append(log)
                got = 0
                digest = hashlib.sha256()
                view = memoryview(buf)
                while got < n:
                    k = conn.recv_into(buf, min(len(buf), n - got))
                    if not k:
                        raise ConnectionError(f"sink: closed after {got} of {n} bytes")
                    got += k
                    digest.update(view[:k])
                    log.append((time.monotonic(), got))
                self.digests.append(digest.hexdigest())
                conn.sendall(DONE)
        except (OSError, ConnectionError) as exc:
            self.errors.append(exc)
        finally:
            conn.close()

    def close(self) -> None:
        self._closed.set()
        self.sock.close()
        for c in self._conns:
            try:
                c.close()
            except OSError:
                pass
        self._thread.join(2.0)

    def __enter__(self) -> "SinkServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(address: str, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to 'host:port' with Nagle off and a long I/O timeout, as the measuring client uses."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(IO_TIMEOUT_S)
    return sock


def ping(sock: socket.socket, n: int = 10) -> list[float]:
    """RTTs in ms of `n` 1-byte round trips on a connected socket to a SinkServer."""
    out = []
    for _ in range(n):
        t = time.monotonic()
        sock.sendall(PING)
        if _recv_exact(sock, 1) != PING:
            raise ConnectionError("sink: bad ping reply")
        out.append((time.monotonic() - t) * 1e3)
    return out


def bulk(sock: socket.socket, nbytes: int) -> float:
    """Send `nbytes` and wait for the sink's receipt; seconds from the first byte sent to the receipt."""
    payload = memoryview(PATTERN)   # reused: the sender allocates nothing per send
    t0 = time.monotonic()
    sock.sendall(BULK + struct.pack("!Q", nbytes))
    left = nbytes
    while left:
        k = min(left, len(payload))
        sock.sendall(payload[:k])
        left -= k
    if _recv_exact(sock, 1) != DONE:
        raise ConnectionError("sink: bad receipt")
    return time.monotonic() - t0


def goodput_mbps(nbytes: int, seconds: float, rtt_ms: float) -> float:
    """Payload rate once one RTT (the last byte's trip plus the receipt's) is taken off the time."""
    return nbytes * 8 / max(1e-6, seconds - rtt_ms / 1e3) / 1e6


def rate_between(log: Sequence[tuple[float, int]], t0: float, t1: float) -> float:
    """Mbit/s that arrived between monotonic times t0 and t1 according to an arrivals log."""
    before = max((b for t, b in log if t <= t0), default=0)
    upto = max((b for t, b in log if t <= t1), default=0)
    return (upto - before) * 8 / (t1 - t0) / 1e6


def _row(mode: str, in_netns: bool, packet: bool, mbps: float, latency_ms: float, nbytes: int, repeats: int) -> list[str]:
    from geofed.p2p.wan.config import EmulationConfig, LinkSpec
    from geofed.p2p.wan.emulator import WanEmulator
    cfg = EmulationConfig(mode=mode, preset=None, endpoints_in_netns=in_netns, kernel_latency="packet" if packet else "proxy",
                          default=LinkSpec(latency_ms=latency_ms, bandwidth_mbps=mbps))
    with WanEmulator(cfg, ["a", "b"]) as emu:
        if mode == "kernel" and in_netns:
            return _kernel_row(emu, mbps, latency_ms, nbytes, repeats)
        with SinkServer() as sink:
            sock = connect(emu.route("a", "b", sink.address))
            label = f"kernel {cfg.kernel_latency}" if mode == "kernel" else mode
            return _measure(sock, label, mbps, latency_ms, nbytes, repeats)


def _kernel_row(emu, mbps: float, latency_ms: float, nbytes: int, repeats: int) -> list[str]:
    from geofed.p2p.wan.kernel import socket_in_namespace
    with SinkServer("0.0.0.0", sock=socket_in_namespace(emu.kernel.namespace("b"))) as sink:
        host, port = emu.route("a", "b", f"0.0.0.0:{sink.port}").split(":")
        sock = socket_in_namespace(emu.kernel.namespace("a"))
        sock.settimeout(IO_TIMEOUT_S)
        sock.connect((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _measure(sock, f"kernel {emu.config.kernel_latency} (netns endpoints)", mbps, latency_ms, nbytes, repeats)


def _measure(sock: socket.socket, mode: str, mbps: float, latency_ms: float, nbytes: int, repeats: int) -> list[str]:
    with sock:
        rtt = statistics.median(ping(sock, 10))
        ratios = []
        for _ in range(repeats):
            ratios.append(goodput_mbps(nbytes, bulk(sock, nbytes), 2 * latency_ms) / mbps)
    return [mode, f"{mbps:g}", f"{latency_ms:g}", f"{nbytes / 1e6:g}", f"{2 * latency_ms:g}", f"{rtt:.1f}",
            " ".join(f"{r:.3f}" for r in ratios)]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m geofed.bench.wan_measure`: print the accuracy table of docs/wan.md (measured RTT and
    goodput against the configured link)."""
    p = argparse.ArgumentParser(prog="python -m geofed.bench.wan_measure", description=__doc__)
    p.add_argument("--mode", choices=["proxy", "kernel"], default="proxy")
    p.add_argument("--netns-endpoints", action="store_true", help="kernel mode: client and sink inside the namespaces")
    p.add_argument("--packet", action="store_true", help="kernel mode: kernel_latency packet (TUN delay line)")
    p.add_argument("--mbps", type=float, nargs="+", default=[10, 50, 100, 200])
    p.add_argument("--latency-ms", type=float, default=40.0)
    p.add_argument("--seconds", type=float, default=1.5, help="size each transfer to take about this long")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    head = ["mode", "Mbit/s", "one-way ms", "MB", "RTT cfg", "RTT median", "goodput / configured (each run)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for mbps in args.mbps:
        nbytes = int(mbps * 1e6 / 8 * args.seconds)
        print("| " + " | ".join(_row(args.mode, args.netns_endpoints, args.packet, mbps, args.latency_ms, nbytes, args.repeats)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
