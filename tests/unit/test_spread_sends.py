"""sync.spread_sends: overlapped pushes paced over the round (p2p/spread.py). The schedule, the
estimator's reading of a paced push, the config's refusals, and over the in-memory transport that
pacing changes when bytes go out, never what is trained."""

from __future__ import annotations

import time

import pytest
import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.p2p.estimator import LinkEstimator
from geofed.p2p.spread import MIN_CHUNK_BYTES, TICK_S, SpreadClock, spread_chunk_bytes
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.messages import RoundPlan

REGIONS = ["a", "b", "c"]


def test_a_spread_push_is_cut_into_chunks_one_tick_apart_none_below_the_floor():
    one_mib = 1 << 20
    assert spread_chunk_bytes(100_000, one_mib, 0.0) == one_mib          # not spread: line rate, big chunks
    size = spread_chunk_bytes(100_000, one_mib, 1.0)                    # 1 s: a chunk every tick
    assert -(-100_000 // size) == round(1.0 / TICK_S)
    size = spread_chunk_bytes(3_000, one_mib, 1.0)                      # small: never under the floor
    assert size >= MIN_CHUNK_BYTES and -(-3_000 // size) == 3_000 // MIN_CHUNK_BYTES
    assert spread_chunk_bytes(MIN_CHUNK_BYTES - 1, one_mib, 1.0) == one_mib  # one chunk anyway
    assert spread_chunk_bytes(10 << 20, 1 << 18, 0.1) == 1 << 18       # the transport's largest chunk holds


def test_the_clock_releases_the_first_chunk_at_once_and_the_last_at_the_end_of_the_spread():
    clock = SpreadClock(0.3, 4)
    t0 = time.monotonic()
    times = []
    for i in range(4):
        clock.wait(i)
        times.append(time.monotonic() - t0)
    assert times[0] < 0.05
    for i in (1, 2, 3):  # never early; late only by the scheduler's slack
        assert times[i] >= 0.1 * i - 0.005
    assert SpreadClock(5.0, 1).start is None  # one chunk: nothing to pace
    one = SpreadClock(5.0, 1)
    t0 = time.monotonic()
    one.wait(0)
    assert time.monotonic() - t0 < 1.0


def test_a_paced_push_that_ended_with_its_pace_is_no_bandwidth_sample():
    est = LinkEstimator()
    est.observe_rtt(0.08)
    est.observe_transfer(1_000_000, 0.08 + 8e6 / 16e6)   # 1 MB in 0.5 s + RTT: 16 Mbit/s
    before = est.bandwidth_bps
    est.observe_transfer(1_000_000, 1.25, spread_s=1.2)   # paced over 1.2 s: the pace, not the link
    assert est.bandwidth_bps == before and est.spread_transfers == 1 and est.transfers == 2
    assert est.snapshot()["spread_transfers"] == 1
    # ...but one that ran far past its spread was held back by the link, and measures it.
    for _ in range(est.window):
        est.observe_transfer(1_000_000, 0.08 + 8e6 / 2e6, spread_s=0.5)  # 2 Mbit/s: 4 s of data
    assert est.bandwidth_bps == pytest.approx(2e6, rel=0.01)
    again = LinkEstimator()
    again.load_state_dict(est.state_dict())
    assert again.spread_transfers == 1


def _cfg(*, spread=0.0, overlap="eager", fragments=1, extra=None):
    m = {"run": {"name": "t", "seed": 5},
         "task": {"kind": "mlp-digits", "hidden": 16},
         "regions": {"names": REGIONS},
         "sync": {"overlap": overlap, "fragments": fragments, "spread_sends": spread, "outer": {"momentum": 0.5},
                  "inner": {"lr": 0.01}},
         "compression": {"codec": "int8", "error_feedback": True},
         "network": {"emulation": {"mode": "none"}}}
    m["sync"].update(extra or {})
    return config_from_mapping(m)


@pytest.mark.parametrize("spread, overlap, words", [
    (0.5, False, "needs sync.overlap"), (0.95, True, r"\[0, 0.9\]"), (-0.1, "eager", r"\[0, 0.9\]")])
def test_config_refuses_spread_without_overlap_or_out_of_range(spread, overlap, words):
    with pytest.raises(ValueError, match=f"spread_sends.*{words}"):
        _cfg(spread=spread, overlap=overlap)


@pytest.mark.parametrize("overlap, fragments", [(True, 1), ("eager", 2)])
def test_spreading_changes_when_bytes_go_not_what_is_trained(tmp_path, overlap, fragments):
    models, records = {}, {}
    for spread in (0.0, 0.8):
        c = InProcessRegions(_cfg(spread=spread, overlap=overlap, fragments=fragments), tmp_path / f"s{spread}")
        try:
            out = [c.run_round({reg: RoundPlan(round=r, H=6, final=(r == 4)) for reg in REGIONS}) for r in range(5)]
            models[spread] = {reg: [g.clone() for g in w.algorithm.eval_params()] for reg, w in c.workers.items()}
            records[spread] = [t for rec in out for m in rec.values() for t in m.exchange.transfers
                               if t["direction"] == "send"]
        finally:
            c.close()
    for reg in REGIONS:
        assert all(torch.equal(x, y) for x, y in zip(models[0.0][reg], models[0.8][reg])), reg
    spread = [t for t in records[0.8] if "spread_s" in t]
    assert not any("spread_s" in t for t in records[0.0])
    # every push is spread (0.8 of the round's compute; hurried when the next round's compute ends,
    # which in-process comes first)...
    assert spread and all(t["spread_s"] > 0 for t in spread)
    # ...except the final round's exchange, which nothing computes behind: it goes at once
    assert len(records[0.8]) - len(spread) == len(REGIONS) * (len(REGIONS) - 1)


def test_hurry_releases_what_is_left_of_every_push_in_flight():
    import threading

    from geofed.p2p.spread import SpreadPushes

    pushes = SpreadPushes()
    done = []

    def push():
        with pushes.track(SpreadClock(30.0, 4)) as clock:
            for i in range(4):
                clock.wait(i)
        done.append(time.monotonic())

    threads = [threading.Thread(target=push) for _ in range(2)]
    for th in threads:
        th.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert pushes.hurry() == 2
    for th in threads:
        th.join(5)
    assert len(done) == 2 and all(t - t0 < 2.0 for t in done)  # not the 30 s the spread planned
    assert pushes.hurry() == 0  # nothing tracked once they ended


def test_the_window_is_the_median_compute_plus_the_longest_wait_and_the_spread_a_share_of_the_shortest():
    from geofed.regions.sync.overlap import OverlapWindow

    plan, final = RoundPlan(round=1, H=4), RoundPlan(round=9, H=4, final=True)
    p = OverlapWindow(0.5, rounds=3)
    got = [p.note(plan, {"compute_s": c}) for c in (2.0, 1.0, 3.0, 4.0, 5.0)]  # no waits between rounds noted
    assert got == [(2.0, 1.0), (1.5, 0.5), (2.0, 0.5), (3.0, 0.5), (4.0, 1.5)]
    assert p.note(final, {"compute_s": 9.0}) == (0.0, 0.0)
    assert OverlapWindow(0.0).note(plan, {"compute_s": 2.0}) == (2.0, 0.0)  # no spread; the window still counts
    q = OverlapWindow(0.0)
    q.note(plan, {"compute_s": 1.0})
    time.sleep(0.3)  # the region waited for the barrier between rounds
    q.started()
    window, _ = q.note(plan, {"compute_s": 1.0})
    assert 1.25 < window < 1.6  # the next result is needed after the wait and the next compute
