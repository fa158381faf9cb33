"""Issue 37 item 1: a sender whose own CPU is busy (us-east-1 evaluates the model while its probes
run) neither ends the run with its busy readings nor keeps them once it is calm again.

Two regions exchange ~10 kB fp16 updates through real Exchangers over mutual-TLS gRPC and the
in-process WAN emulator. Python threads of this process that never sleep (what an evaluation
running beside a region's sends is to them: threads waiting for the GIL and a core) run during the
set-up probes and the first BUSY_S seconds of rounds, then stop. The pings stay within the path
(a ping is one message: a few ms of waiting), so nothing but the transfers themselves showed it.

Before (59d752a, without the StallMeter and the busy refunds): the set-up probes' low readings were
clean samples (confidence 1), the link's one free re-probe went out while the threads still ran,
and the budget (10% of 10 kB updates) never paid for another: the estimates ended at 0.453 and
0.418 of the link, as the default run's out-links of us-east-1 did (0.42-0.66).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from exchange_rounds import run_rounds

from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.estimator import LinkEstimator
from geofed.p2p.grpc_transport import GrpcTransport
from geofed.p2p.tls import load_tls, make_pki
from geofed.p2p.wan.config import EmulationConfig, LinkSpec
from geofed.p2p.wan.emulator import WanEmulator
from geofed.regions.exchange import Exchanger

pytestmark = pytest.mark.timeout(150)

REGIONS = ("a", "b")
RATE = 40.0  # Mbit/s of every link
# The calm part holds a doubled re-probe interval (REPROBE_MIN_INTERVAL_S 10 s, doubled while a re-probe
# reads busy) and a round: with 16 s (one interval) a fresh-clone CI run on 2026-12-07 ended with a->b at
# 0.119 of the link, its one calm re-probe gone before the low reading was replaced.
BUSY_S, CALM_S = 8.0, 26.0
STALE_S = 3.0  # so that a clean estimate goes stale (and is re-probed) within the busy part


def _hog(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(10_000):  # pure Python: holds the GIL for its switch interval at a time
            x += i


def test_busy_sender_readings_neither_set_the_estimate_nor_outlast_the_load(tmp_path):
    pki = make_pki(tmp_path / "tls", list(REGIONS))
    cfg = EmulationConfig(mode="proxy", preset=None,
                          default=LinkSpec(latency_ms=20.0, bandwidth_mbps=RATE, jitter_ms=0.0, loss=0.0), links={})
    transports = {r: GrpcTransport(r, tls=load_tls(pki.directory, r), max_message_bytes=4 << 20) for r in REGIONS}
    exchangers: dict[str, Exchanger] = {}
    stop, hogs = threading.Event(), []
    with WanEmulator(cfg, list(REGIONS)) as emu:
        try:
            addrs = {}
            for r, t in transports.items():
                t.mailbox.set_validator(lambda sender, round, payload: len(payload))
                addrs[r] = t.start()
            for r, t in transports.items():
                t.connect({p: emu.route(r, p, addrs[p]) for p in REGIONS if p != r})
                ex = exchangers[r] = Exchanger(t, error_feedback=False, deadline=AdaptiveDeadline(2.0, 0.2, 10.0, 3.0),
                                               send_timeout_s=30.0)
                for p in REGIONS:
                    if p != r:
                        ex.estimators[p] = LinkEstimator(stale_s=STALE_S)
            hogs = [threading.Thread(target=_hog, args=(stop,), daemon=True) for _ in range(2)]
            for h in hogs:
                h.start()
            probes = [threading.Thread(target=ex.probe_links, args=([p for p in REGIONS if p != r],),
                                       kwargs={"duration_s": 0.25, "max_bytes": 8 << 20})
                      for r, ex in exchangers.items()]
            for t in probes:
                t.start()
            for t in probes:
                t.join()
            tensors = [torch.randn(5000)]  # fp16: 10 kB, the default run's update
            r = run_rounds(exchangers, tensors, 0, time.monotonic() + BUSY_S)
            stop.set()
            for h in hogs:
                h.join()
            run_rounds(exchangers, tensors, r, time.monotonic() + CALM_S)
            for ex in exchangers.values():
                ex.reprober.wait(30.0)
            stats = emu.link_stats()
            ratios, snaps = {}, {}
            for region, ex in exchangers.items():
                for link, snap in ex.link_estimates(region).items():
                    snaps[link] = snap
                    ratios[link] = round(snap["bandwidth_mbps"] / RATE, 3)
            assert all(abs(x - 1) <= 0.25 for x in ratios.values()), (ratios, snaps, stats)
        finally:
            stop.set()
            for h in hogs:
                h.join()
            for ex in exchangers.values():
                ex.close()
            for t in transports.values():
                t.close()
