"""Kernel mode: one network namespace per region, a veth pair per region pair, tc tbf per egress.

Bandwidth is the kernel's (tbf on each veth end shapes that direction); latency, jitter, loss
and outages stay with the user-space proxy because this kernel has no netem. Namespaces are
named `<prefix><run id>-<index>`; `cleanup(prefix)` (`geofed net cleanup`) removes leftovers of
runs that died without stop().
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import logging
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
TC_TIMEOUT_S = 10.0
# tbf counts wire bytes; the proxy and the presets count payload. A full 1500-byte packet carries
# 1448 bytes of TCP payload (timestamps on) in 1514 bytes on a veth, so tbf gets the rate x 1514/1448
# (KernelNet.overhead generalises it to other MTUs and to TUN devices).
WIRE_OVERHEAD = 1514 / 1448
TBF_QUEUE_S = 0.05
# tbf needs a burst of a few ms at high rates (64 KiB at 500 Mbit/s reached only 70-80%), but a
# burst is also a free head start, so it grows with the rate: max(configured, rate x 3 ms).
TBF_BURST_S = 0.003
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000


def kernel_unavailable() -> str | None:
    """Why kernel mode cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return f"needs root (euid is {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2) on PATH"
    if not os.path.exists("/proc/self/ns/net"):
        return "needs network namespaces (/proc/self/ns/net missing)"
    return None


def run_tool(*args: str) -> str:
    """Run `ip` or `tc` (`args` is its argv) and return its stdout; RuntimeError naming the command when it fails."""
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=TC_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"kernel: `{' '.join(args)}` took more than {TC_TIMEOUT_S} s") from None
    if out.returncode != 0:
        raise RuntimeError(f"kernel: `{' '.join(args)}` failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def list_namespaces(prefix: str) -> list[str]:
    """Network namespaces whose name starts with `prefix`, sorted (runs `ip netns list`)."""
    names = [line.split()[0] for line in run_tool("ip", "netns", "list").splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def cleanup(prefix: str = "gfw") -> list[str]:
    """Delete every namespace whose name starts with `prefix` (their veths go with them).

    Processes still running in one (the Ray nodes of a shaped cluster whose owner was killed)
    are killed first: deleting the name alone would leave them, and their namespace, running."""
    removed = []
    for name in list_namespaces(prefix):
        try:
            for pid in run_tool("ip", "netns", "pids", name).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            run_tool("ip", "netns", "delete", name)
            removed.append(name)
        except RuntimeError as exc:
            log.warning("%s", exc)
    return removed


def cleanup_main(argv: Sequence[str] | None = None) -> int:
    """`geofed net cleanup [--prefix P]`: remove namespaces left by runs that crashed."""
    import argparse
    p = argparse.ArgumentParser(prog="geofed net cleanup")
    p.add_argument("--prefix", default="gfw", help="namespace name prefix (network.emulation.netns_prefix)")
    args = p.parse_args(argv)
    reason = kernel_unavailable()
    if reason:
        print(f"geofed net cleanup: {reason}")
        return 2
    removed = cleanup(args.prefix)
    print(f"removed {len(removed)} namespace(s)" + (": " + " ".join(removed) if removed else ""))
    return 0


_libc = None


def _setns(path: str) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def in_namespace(name: str, make):
    """`make()` run in network namespace `name`: what it creates (a socket, a TUN device) stays there.

    The network namespace is per thread, so a short-lived thread enters the namespace, runs
    `make` and ends.
    """
    box: dict = {}

    def run():
        try:
            _setns(f"/var/run/netns/{name}")
            box["value"] = make()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run, name=f"netns-{name}", daemon=True)
    t.start()
    t.join(TC_TIMEOUT_S)
    if "error" in box:
        raise box["error"]
    if "value" not in box:
        raise RuntimeError(f"kernel: work in namespace {name} took more than {TC_TIMEOUT_S} s")
    return box["value"]


def socket_in_namespace(name: str, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket that lives in network namespace `name`.

    A stream socket names its protocol (IPPROTO_TCP) so that asyncio sets TCP_NODELAY on it (it
    checks `sock.proto`, which is 0 for `socket.socket(family, SOCK_STREAM)`): with Nagle on, a
    relay held gRPC's small HTTP/2 frames behind an unacknowledged segment for one emulated RTT,
    and a cold mTLS ping took 5-6 RTT where gRPC's own socket (TCP_NODELAY) takes 4.
    """
    proto = socket.IPPROTO_TCP if kind == socket.SOCK_STREAM else 0
    return in_namespace(name, lambda: socket.socket(family, kind, proto))


def open_tun(device: str) -> int:
    """A non-blocking TUN device (IP packets, no header) made in the calling thread's namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class KernelNet:
    """The namespaces, veths and qdiscs of one emulator; down() removes them (also at exit)."""

    def __init__(self, regions: Sequence[str], *, prefix: str, burst_kb: int, run_id: str | None = None,
                 tun: bool = False, mtu: int = 1500):
        reason = kernel_unavailable()
        if reason:
            raise RuntimeError(f"mode: kernel {reason}; use mode: proxy")
        if len(regions) > 250:
            raise ValueError(f"regions: kernel mode addresses at most 250 regions, got {len(regions)}")
        self.regions = list(regions)
        self.index = {r: i for i, r in enumerate(self.regions)}
        self.run_id = run_id or secrets.token_hex(3)
        self.names = {r: f"{prefix}{self.run_id}-{i}" for r, i in self.index.items()}
        self.min_burst = burst_kb * 1024
        self._burst: dict[tuple[str, str], int] = {}
        self._made: list[str] = []
        # tun: each pair is joined by two TUN devices whose packets a user-space delay line carries
        # (tun_fds[(a, b)] is a's end); else by a veth pair.
        self.tun = tun
        self.mtu = mtu
        self.tun_fds: dict[tuple[str, str], int] = {}
        # tbf counts what the device carries: IP packets on a TUN, plus the 14-byte Ethernet header on a veth.
        self.overhead = (mtu + (0 if tun else 14)) / (mtu - 52)

    def namespace(self, region: str) -> str:
        return self.names[region]

    def _end(self, src: str, dst: str) -> tuple[str, str, str]:
        """(namespace, device, address) of `src`'s end of the src-dst veth."""
        i, j = self.index[src], self.index[dst]
        lo, hi = min(i, j), max(i, j)
        host = 1 if i == lo else 2
        return self.names[src], f"v{j}", f"10.{lo + 1}.{hi + 1}.{host}"

    def peer_address(self, src: str, dst: str) -> str:
        """`dst`'s address on the src-dst veth: what `src` dials to reach `dst`."""
        return self._end(dst, src)[2]

    def up(self, rates_bps: dict[tuple[str, str], float]) -> None:
        atexit.register(self.down)
        try:
            for r in self.regions:
                run_tool("ip", "netns", "add", self.names[r])
                self._made.append(self.names[r])
                run_tool("ip", "-n", self.names[r], "link", "set", "lo", "up")
            for a in self.regions:
                for b in self.regions:
                    if self.index[a] < self.index[b]:
                        self._link(a, b, rates_bps)
        except BaseException:
            self.down()
            raise

    def _link(self, a: str, b: str, rates_bps: dict[tuple[str, str], float]) -> None:
        ns_a, dev_a, ip_a = self._end(a, b)
        ns_b, dev_b, ip_b = self._end(b, a)
        if self.tun:
            self.tun_fds[(a, b)] = in_namespace(ns_a, lambda: open_tun(dev_a))
            self.tun_fds[(b, a)] = in_namespace(ns_b, lambda: open_tun(dev_b))
        else:
            run_tool("ip", "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
        for ns, dev, ip in ((ns_a, dev_a, ip_a), (ns_b, dev_b, ip_b)):
            run_tool("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            run_tool("ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu), "up")
        self.set_rate((a, b), rates_bps[(a, b)])
        self.set_rate((b, a), rates_bps[(b, a)])

    def set_rate(self, pair: tuple[str, str], rate_bps: float) -> None:
        """(Re)shape pair[0] -> pair[1]: tbf on the egress of pair[0]'s veth end.

        The burst only ever grows: shrinking it under a running flow stalled the flow (FIELD-NOTES).
        """
        ns, dev, _ = self._end(*pair)
        wire_bps = rate_bps * self.overhead
        burst = max(self._burst.get(pair, 0), self.min_burst, int(wire_bps * TBF_BURST_S), self.mtu + 64)
        self._burst[pair] = burst
        limit = max(4 * burst, int(wire_bps * TBF_QUEUE_S))
        run_tool("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
             "rate", f"{max(8000, int(wire_bps * 8))}bit", "burst", str(burst), "limit", str(limit))

    def qdisc(self, pair: tuple[str, str]) -> str:
        ns, dev, _ = self._end(*pair)
        return run_tool("tc", "-n", ns, "-s", "qdisc", "show", "dev", dev)

    def socket_in(self, region: str, family: int = socket.AF_INET) -> socket.socket:
        return socket_in_namespace(self.names[region], family)

    def down(self) -> None:
        """Delete this emulator's namespaces (their veths and qdiscs go with them). Idempotent."""
        for fd in self.tun_fds.values():
            os.close(fd)
        self.tun_fds = {}
        for name in self._made:
            try:
                run_tool("ip", "netns", "delete", name)
            except RuntimeError as exc:
                if "No such file" not in str(exc):
                    log.warning("%s", exc)
        self._made = []
        atexit.unregister(self.down)
