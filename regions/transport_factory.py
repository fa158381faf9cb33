"""Build a region's gRPC transport from the run config (TLS material from the run directory)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from geofed.p2p.grpc_transport import GrpcTransport
from geofed.p2p.tls import load_tls

log = logging.getLogger(__name__)


def make_transport(cfg: Any, region: str, run_dir: Path) -> GrpcTransport:
    net, sec = cfg.network, cfg.security
    tls = load_tls(run_dir / "tls", region) if sec.tls else None
    if tls is None:
        log.warning("region %s: security.tls is false: updates travel in plaintext and peers are not authenticated", region)
    port = 0
    if net.port_range is not None:
        port = net.port_range  # the transport tries each port of the range in turn
    return GrpcTransport(region, bind_host=net.bind_host, port=port, advertised_host=net.advertised_host,
                         tls=tls, max_message_bytes=net.max_message_mb << 20, round_window=sec.round_window,
                         chunk_bytes=net.chunk_kb << 10)
