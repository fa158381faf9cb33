"""Build a region's gRPC transport from the run config.

TLS material normally arrives with the actor (the driver hands each region its own certificate
and key when it creates the actor, so no node needs the driver's disk); reading it from
RUN_DIR/tls is the fallback for workers built in-process (tests, benches)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from geofed.p2p.grpc_transport import GrpcTransport
from geofed.p2p.tls import TlsMaterial, load_tls

from .limits import WireLimits


def make_transport(cfg: Any, region: str, run_dir: Path, *, limits: WireLimits, tls: TlsMaterial | None = None,
                   advertised_host: str | None = None) -> GrpcTransport:
    """`advertised_host` overrides network.advertised_host (the actor passes its node's address);
    `limits` come from the region's model (regions/limits.py)."""
    net, sec = cfg.network, cfg.security
    if not sec.tls:
        tls = None
    elif tls is None:
        tls = load_tls(run_dir / "tls", region)
    port = 0
    if net.port_range is not None:
        port = net.port_range  # the transport tries each port of the range in turn
    return GrpcTransport(region, bind_host=net.bind_host, port=port, advertised_host=advertised_host or net.advertised_host,
                         tls=tls, max_message_bytes=limits.max_message_bytes, round_window=sec.round_window,
                         chunk_bytes=net.chunk_kb << 10, max_peers=max(1, len(cfg.regions.names) - 1),
                         max_rpc_s=limits.max_rpc_s, peer_budget_bytes=limits.peer_budget_bytes,
                         max_state_bytes=limits.max_state_bytes)
