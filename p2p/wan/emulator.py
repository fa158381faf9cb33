"""WanEmulator: the public face of p2p.wan. Owns the event loop thread, the routes and the schedule."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence

from .config import EmulationConfig, LinkSpec, ScheduleEvent
from .links import LinkTable, Pair, link_name
from .presets import load_preset
from .proxy import Proxy, Route, open_tcp
from .relay import Relay, tcp_opener
from .shaper import LinkRuntime

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
CALL_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
LOOP_NICE = -10


def split_target(target: str) -> tuple[str, int]:
    """Parse 'host:port' ('[v6]:port' too) into (host, port); ValueError for anything else."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target: expected 'host:port', got {target!r}")
    return host.strip("[]"), int(port)


class WanEmulator:
    """Shaped links between `regions` as `config` says; see docs/wan.md.

    Proxy mode: `route(src, dst, target)` returns a local address whose connections are
    forwarded to `target` with src->dst bytes shaped by link (src, dst) and reply bytes by
    (dst, src). Kernel mode: tc tbf on the links between one network namespace per region does
    the bandwidth, and the same proxy (veth links) or a packet delay line (TUN links,
    `kernel_latency: packet`) adds latency, jitter, loss and outages. Mode "none": `route`
    returns `target` unchanged.
    """

    def __init__(self, config: EmulationConfig, regions: Sequence[str]):
        self.config = config
        self.regions = tuple(regions)
        self.table = LinkTable(config, self.regions, load_preset(config.preset) if config.preset else None)
        self._lock = threading.RLock()          # routes and life cycle; never taken on the loop thread
        self._sched_lock = threading.Lock()     # schedule firing; never held while waiting on the loop
        self._routes: dict[tuple[str, str, str], Route] = {}
        self._fired: set[int] = set()
        self._t0: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._timer: asyncio.Future | None = None
        self._stopped = False
        self._relays: list[Relay] = []
        self.kernel = None
        if config.mode == "kernel":
            from .kernel import KernelNet  # only kernel mode pays for (and checks) root + tc
            self.kernel = KernelNet(self.regions, prefix=config.netns_prefix, burst_kb=config.tbf_burst_kb,
                                    tun=config.kernel_latency == "packet", mtu=config.kernel_mtu)
        self.packet = self.kernel is not None and self.kernel.tun
        self._packet_paths: list = []
        self._packet_routes: dict[tuple[str, str, str], str] = {}
        self.proxy = Proxy(table=self.table, clock=self.clock, seed=config.seed,
                           cap_bytes=int(config.max_buffer_mb * 2**20),
                           open_upstream=self._open_kernel if self.kernel is not None else open_tcp,
                           shape_bandwidth=self.kernel is None, slow_start_after_idle=config.slow_start_after_idle)

    # -- life cycle -----------------------------------------------------------------------

    def clock(self) -> float:
        """Seconds since start() (0 before it): the clock of `at_s` events and outage windows."""
        return 0.0 if self._t0 is None else time.monotonic() - self._t0

    @property
    def start_time(self) -> float | None:
        """time.monotonic() at start(): `at_s` events fire at start_time + at_s."""
        return self._t0

    def start(self) -> "WanEmulator":
        """Start the loop thread (kernel mode: make the namespaces first); on failure, undo it all."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> "WanEmulator":
        with self._lock:
            if self._stopped:
                raise RuntimeError("WanEmulator: start() after stop(); make a new emulator")
            if self._t0 is not None:
                return self
            if self.kernel is not None:
                self.kernel.up({p: self.table.shape(*p).rate_bps for p in self.table.pairs})
            self._t0 = time.monotonic()
            for ev in self.config.schedule:
                if ev.at_s is not None and ev.outage_s is not None:
                    self.table.add_outage(ev, ev.at_s)
            if self.config.mode == "none":
                return self
            ready = threading.Event()
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._run_loop, args=(ready,), name="geofed-wan", daemon=True)
            self._thread.start()
            if not ready.wait(START_TIMEOUT_S):
                raise RuntimeError(f"WanEmulator: event loop did not start within {START_TIMEOUT_S} s")
            for route in self._routes.values():
                self._call(self.proxy.serve(route))
            if self.packet:
                self._call(self._start_packet_paths())
            self._fire_due_time_events()
            self._timer = asyncio.run_coroutine_threadsafe(self._run_schedule(), self._loop)
            return self

    async def _start_packet_paths(self) -> None:
        import random

        from .delayline import PacketPath
        assert self.kernel is not None
        loop = asyncio.get_running_loop()
        for i, (a, b) in enumerate(self.table.pairs):
            path = PacketPath(pair=(a, b), read_fd=self.kernel.tun_fds[(a, b)], write_fd=self.kernel.tun_fds[(b, a)],
                              table=self.table, link=self.proxy.links[(a, b)], clock=self.clock,
                              rng=random.Random(self.config.seed * 1_000_003 + i), cap_bytes=self.proxy.cap_bytes)
            path.start(loop)
            self._packet_paths.append(path)

    async def _close_all(self) -> None:
        for path in self._packet_paths:
            path.stop()
        await self.proxy.close()
        for relay in self._relays:
            await relay.close()

    def _run_loop(self, ready: threading.Event) -> None:
        assert self._loop is not None
        # The emulated network should not wait behind training on a busy machine: on 2 cores with
        # 3 busy processes the 80 ms RTT read 92-96 ms at nice 0 and 84-92 ms at -10 (best effort:
        # only root may lower it, and Linux takes a thread id here).
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOOP_NICE)
        except OSError:
            pass
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(ready.set)
        self._loop.run_forever()

    def _call(self, coro, timeout: float = CALL_TIMEOUT_S):
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        """Close every listener and connection, end the loop thread, remove namespaces. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                if self._loop is not None and self._thread is not None and self._thread.is_alive():
                    if self._timer is not None:
                        self._timer.cancel()
                    try:
                        self._call(self._close_all(), STOP_TIMEOUT_S)
                    except Exception as exc:  # noqa: BLE001 - stop must go on and free the rest
                        log.warning("wan: closing the proxy: %s", exc)
                    self._loop.call_soon_threadsafe(self._loop.stop)
                    self._thread.join(STOP_TIMEOUT_S)
                    if self._thread.is_alive():
                        log.warning("wan: event loop thread did not end within %s s", STOP_TIMEOUT_S)
                    else:
                        self._loop.close()
                for route in self._routes.values():
                    if route.server is None:
                        route.sock.close()
            finally:
                if self.kernel is not None:
                    self.kernel.down()

    def __enter__(self) -> "WanEmulator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- routes ---------------------------------------------------------------------------

    def route(self, src: str, dst: str, target: str) -> str:
        """'host:port' that region `src` dials to reach region `dst`'s server at `target`.

        Kernel mode (after start()): bytes cross the src-dst veth, shaped by tbf. By default
        client and server stay in the host namespace and a relay in `dst`'s namespace dials
        `target`; with `endpoints_in_netns` the address is on the loopback of `src`'s namespace
        and `target`'s port is dialled at `dst`'s veth address, so `dst`'s server must listen on
        0.0.0.0 inside its namespace.
        """
        self.table.shape(src, dst)   # ValueError naming the regions when the link does not exist
        if self.config.mode == "none":
            return target
        host, port = split_target(target)
        with self._lock:
            if self._stopped:
                raise RuntimeError("WanEmulator: route() after stop()")
            key = (src, dst, target)
            if self.kernel is not None and self._t0 is None:
                raise RuntimeError("WanEmulator.route: kernel mode makes its namespaces in start(); call start() first")
            if self.packet:
                if key not in self._packet_routes:
                    self._packet_routes[key] = self._packet_route(src, dst, host, port)
                return self._packet_routes[key]
            if key in self._routes:
                return self._routes[key].address
            sock = self._listen_socket(src)
            route = Route(src=src, dst=dst, target_host=host, target_port=port, sock=sock)
            if self.kernel is not None:
                route.upstream = self._kernel_upstream(src, dst, host, port)
            bound_host, bound_port = sock.getsockname()[:2]
            route.address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
            if self._loop is not None:
                self._call(self.proxy.serve(route))
            self._routes[key] = route
            return route.address

    def _kernel_upstream(self, src: str, dst: str, host: str, port: int) -> tuple[str, int]:
        """Where the proxy's socket in `src`'s namespace dials: `dst`'s server or a relay to it."""
        assert self.kernel is not None
        peer = self.kernel.peer_address(src, dst)
        if self.config.endpoints_in_netns:
            return peer, port
        return peer, self._relay(self._listen_on(self.kernel.socket_in(dst), peer), tcp_opener(host, port), f"{dst} in")

    def _packet_route(self, src: str, dst: str, host: str, port: int) -> str:
        """kernel_latency packet: no proxy; relays carry host endpoints into and out of the namespaces."""
        assert self.kernel is not None and self._t0 is not None, "kernel mode: start() first"
        peer = self.kernel.peer_address(src, dst)
        if self.config.endpoints_in_netns:
            return f"{peer}:{port}"
        inner = self._relay(self._listen_on(self.kernel.socket_in(dst), peer), tcp_opener(host, port), f"{dst} in")
        outer = self._listen_on(socket.socket(socket.AF_INET6 if ":" in self.config.bind_host else socket.AF_INET,
                                              socket.SOCK_STREAM, socket.IPPROTO_TCP),
                                self.config.bind_host)
        self._relay(outer, lambda: self._open_in(src, (peer, inner)), f"{src} out")
        bound_host, bound_port = outer.getsockname()[:2]
        return f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"

    def _relay(self, sock: socket.socket, opener, name: str) -> int:
        relay = Relay(sock, opener, name)
        self._call(relay.start())
        self._relays.append(relay)
        return sock.getsockname()[1]

    @staticmethod
    def _listen_on(sock: socket.socket, host: str) -> socket.socket:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    def _listen_socket(self, src: str) -> socket.socket:
        # Bound on the caller's thread, so the address is known at once, also before start().
        if self.kernel is not None and self.config.endpoints_in_netns:
            return self._listen_on(self.kernel.socket_in(src), "127.0.0.1")
        family = socket.AF_INET6 if ":" in self.config.bind_host else socket.AF_INET
        # IPPROTO_TCP named, so asyncio sets TCP_NODELAY on the accepted sockets (see kernel.socket_in_namespace).
        return self._listen_on(socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP), self.config.bind_host)

    async def _open_kernel(self, route: Route):
        assert route.upstream is not None
        return await self._open_in(route.src, route.upstream)

    async def _open_in(self, region: str, address: tuple[str, int]):
        """A connection to `address` from a socket in `region`'s namespace (so it crosses that region's links)."""
        assert self.kernel is not None
        sock = self.kernel.socket_in(region, socket.AF_INET)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock, limit=256 * 1024)

    # -- configuration and schedule -------------------------------------------------------

    def add_region(self, region: str, *, like: str | None = None) -> None:
        """Shaped links for a region that joined the run under a new name (LinkTable.add_region
        says which shape each gets); routes to and from it can be asked for from now on. Proxy mode
        only: kernel mode makes its network namespaces and veth links at start."""
        if self.kernel is not None:
            raise ValueError("network.emulation.mode kernel: its network namespaces are made at start; a region "
                             "cannot be added to a running emulator")
        with self._lock:
            if region in self.regions:
                raise ValueError(f"regions: {region!r} is already one of the run's regions")
            # The proxy's links first: link_stats() reads the table's pairs, then each one's runtime.
            for pair in [p for r in self.regions for p in ((region, r), (r, region))]:
                self.proxy.links[pair] = LinkRuntime(pair)
            self.table.add_region(region, like=like)
            self.regions = (*self.regions, region)

    def configured(self, src: str, dst: str) -> LinkSpec:
        """The link's shape now: preset, then `links` overrides, then schedule changes, then bandwidth_scale."""
        return self.table.configured(src, dst)

    def set_round(self, r: int) -> None:
        """Enter round `r`: fires every `at_round <= r` event not fired yet, in (round, file) order."""
        with self._sched_lock:
            due = sorted((ev.at_round, i) for i, ev in enumerate(self.config.schedule)
                         if ev.at_round is not None and ev.at_round <= r and i not in self._fired)
            for _, i in due:
                self._fire(i)

    def _fire(self, i: int) -> None:
        ev: ScheduleEvent = self.config.schedule[i]
        self._fired.add(i)
        pairs = self.table.apply(ev, self.clock(), with_outage=ev.at_s is None)
        log.info("wan: t=%.2fs event %d on %s: set=%s outage_s=%s", self.clock(), i, ev.link, ev.set, ev.outage_s)
        if ev.outage_s is not None and ev.outage_mode == "reset" and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.proxy.reset_links, pairs)
        if self.kernel is not None and ev.set is not None and ev.set.bandwidth_mbps is not None:
            for p in pairs:
                self.kernel.set_rate(p, self.table.shape(*p).rate_bps)

    def _fire_due_time_events(self) -> None:
        with self._sched_lock:
            if self._stopped:
                return
            now = self.clock()
            for at, i in sorted((ev.at_s, i) for i, ev in enumerate(self.config.schedule) if ev.at_s is not None):
                if at <= now and i not in self._fired:
                    self._fire(i)

    async def _run_schedule(self) -> None:
        timed = sorted((ev.at_s, i) for i, ev in enumerate(self.config.schedule) if ev.at_s is not None)
        loop = asyncio.get_running_loop()
        for at, i in timed:
            if i in self._fired:
                continue
            await asyncio.sleep(max(0.0, at - self.clock()))
            if self.kernel is None:
                self._fire_due_time_events()
            else:  # kernel rate changes shell out to tc: keep them off the loop that moves the bytes
                await loop.run_in_executor(None, self._fire_due_time_events)

    # -- stats ----------------------------------------------------------------------------

    def link_stats(self, pairs: Iterable[Pair] | None = None) -> dict[str, dict]:
        """Per directed link "a->b": counters since start and the configured shape now; of `pairs`
        ((src, dst), those the emulator has) or of every link: N(N-1) of them. A round's record that
        asked for every link once per link it reported (driver/emulation.py) was 73% of the driver's
        samples with 64 regions (py-spy, 30 s of rounds: 4,032 links, asked 64 times a round)."""
        now = self.clock()
        wanted = self.table.pairs if pairs is None else [p for p in pairs if p in self.proxy.links]
        return {link_name(p): self._stats_of(p, now) for p in wanted}

    def _stats_of(self, pair: Pair, now: float) -> dict:
        lr = self.proxy.links[pair]
        spec = self.table.configured(*pair)
        outage = self.table.outage(*pair, now)
        goodput = lr.measured_goodput_mbps()
        latency = lr.measured_latency_ms()
        back = self.proxy.links[pair[::-1]].measured_latency_ms()
        rtt = None if latency is None or back is None else latency + back
        return {
            "bytes": lr.bytes,
            "bytes_in": lr.bytes_in,
            "connections": lr.connections,
            "active_connections": lr.active,
            "resets": lr.resets,
            "refused": lr.refused,
            "loss_stalls": lr.loss_stalls,
            "peak_buffered_bytes": lr.peak_buffered,
            "configured_bandwidth_mbps": spec.bandwidth_mbps,
            "configured_latency_ms": spec.latency_ms,
            "configured_jitter_ms": spec.jitter_ms,
            "configured_loss": spec.loss,
            "measured_goodput_mbps": None if goodput is None else round(goodput, 3),
            "measured_latency_ms": None if latency is None else round(latency, 3),
            # one way here plus one way back, as the proxy delivered them (a model of the RTT)
            "measured_rtt_ms": None if rtt is None else round(rtt, 3),
            "configured_rtt_ms": spec.latency_ms + self.table.configured(*pair[::-1]).latency_ms,
            "in_outage": outage is not None,
            "outage_mode": None if outage is None else outage.mode,
            "outage_s": round(self.table.outage_seconds(*pair, now), 3),
        }
