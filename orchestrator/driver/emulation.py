"""Driver-side WAN emulation: one shaped link per directed region pair, run next to the driver."""

from __future__ import annotations

from collections.abc import Sequence

from ..config import RunConfig


def start_emulation(cfg: RunConfig, regions: Sequence[str]):
    """The started emulator, or None when `network.emulation.mode` is none."""
    em = cfg.network.emulation
    if em.mode == "none":
        return None
    from geofed.p2p.wan import WanEmulator

    emulator = WanEmulator(em, list(regions))
    emulator.start()
    return emulator


def configured_link(emulator, src: str, dst: str) -> dict:
    """What the emulator was told for src->dst (RTT = both one-way latencies, so asymmetric links
    are right) and what it measured passing through."""
    stats = emulator.link_stats([(src, dst)]).get(f"{src}->{dst}", {})  # this link's only: N(N-1) in all
    forward, back = emulator.configured(src, dst), emulator.configured(dst, src)
    return {"configured_bandwidth_mbps": forward.bandwidth_mbps,
            "configured_rtt_ms": (forward.latency_ms or 0.0) + (back.latency_ms or 0.0),
            "emulator_goodput_mbps": stats.get("measured_goodput_mbps")}


def add_emulated_region(emulator, cfg: RunConfig, region: str, label: str | None) -> str | None:
    """Links for a region that joined under a new name (driver/membership.py): those of the region
    whose node label (regions.label_key) the joiner was placed by, when one has it (the first in
    regions.names order), else network.emulation.default (and the preset's figures where it knows
    the name). Returns the region whose links it copies, or None."""
    like = None
    if label is not None:
        like = next((r for r in emulator.regions if cfg.regions.label_of(r) == label), None)
    emulator.add_region(region, like=like)
    return like
