"""Driver-side WAN emulation: one shaped link per directed region pair, run next to the driver."""

from __future__ import annotations

from collections.abc import Sequence

from .config import RunConfig


def start_emulation(cfg: RunConfig, regions: Sequence[str]):
    """The started emulator, or None when `network.emulation.mode` is none."""
    em = cfg.network.emulation
    if em.mode == "none":
        return None
    from geofed.p2p.wan import WanEmulator

    emulator = WanEmulator(em, list(regions))
    emulator.start()
    return emulator
