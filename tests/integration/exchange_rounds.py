"""Rounds of real Exchangers, every region at once, for the estimator-under-load tests."""

from __future__ import annotations

import threading
import time

from geofed.compression import CodecSpec
from geofed.regions.exchange import Exchanger


def run_rounds(exchangers: dict[str, Exchanger], tensors, r0: int, until: float, *, compute_s: float = 0.15) -> int:
    """Rounds from `r0` until the monotonic time `until`: each region pushes fp16 to every other and
    waits for them; `compute_s` of sleep stands for a round's compute. Returns the next round."""
    regions = list(exchangers)
    r, fp16, errors = r0, CodecSpec.parse("fp16"), []

    def one(region: str, rnd: int) -> None:
        try:
            peers = [p for p in regions if p != region]
            exchangers[region].exchange(rnd, tensors, out_peers=peers, in_peers=peers, codecs={}, default_codec=fp16)
        except Exception as exc:  # noqa: BLE001 - surfaced in the calling thread
            errors.append(exc)

    while time.monotonic() < until:
        threads = [threading.Thread(target=one, args=(g, r)) for g in regions]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        r += 1
        time.sleep(compute_s)
    return r
