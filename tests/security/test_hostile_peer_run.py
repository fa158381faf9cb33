"""Issue 15, findings 2, 3 and 4, live: a real run (the Runner on the session's Ray, mutual-TLS
gRPC, the digits task) with a compromised peer in it: a thread holding one region's genuine
certificate from the run's tls/ folder, calling another region's server. It pushes updates of huge
finite values (3e38, a valid checksum), updates for the real sender's next rounds before the real
sender does, rounds far in the future, floods FetchState with unread streams, and opens stalled
pushes declaring a gigabyte and the largest size allowed.

On main the run died (FloatingPointError in the receiving region, driver exit 1); before that,
each stalled 1 GiB push took a gigabyte of the region's memory, the FetchState streams pinned the
server's threads and the real sender's pushes were refused as replays. Here the run finishes
within 3 accuracy points of an undisturbed run of the same seed, every attack is refused and
counted by reason, and no region's resident memory passes 1.5x its undisturbed peak.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from geofed.compression import encode_update
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.bench.hostile_peer import HostilePeer
from reliability_harness import BackgroundRun, events

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1"]
TARGET, INSIDER = REGIONS[0], REGIONS[1]  # full topology: the insider is an in-neighbour of the target
HIDDEN = 256  # a state of ~230 KB (model, global model, outer momentum): more than gRPC buffers for an unread stream
SHAPES = [(HIDDEN, 64), (HIDDEN,), (10, HIDDEN), (10,)]  # the digits MLP
ROUNDS = 100


def _config():
    # network.max_message_mb is left at its default: on main that was 1024.
    return config_from_mapping({
        "run": {"name": "hostile", "rounds": ROUNDS, "report": False, "checkpoint_every": 0, "seed": 0},
        "task": {"kind": "mlp-digits", "hidden": HIDDEN},
        "regions": {"names": REGIONS, "num_cpus": 0.5, "max_restarts": 0},
        # 50 ms each way paces a round at ~0.2 s: the attack (~8 s) lands well inside the run. Without
        # it 100 rounds took 8 s and the last stalled pushes could arrive after the last round had
        # reported its refusals.
        "network": {"emulation": {"mode": "proxy", "preset": None,
                                  "default": {"latency_ms": 50, "bandwidth_mbps": 200, "jitter_ms": 0, "loss": 0}}},
        "sync": {"policy": {"kind": "fixed", "H": 10}, "inner": {"lr": 0.01, "lr_decay": "cosine"},
                 "deadline": {"initial_s": 3.0, "min_s": 0.5, "max_s": 4.0}},
    })


def _rss_peaks(run_dir: Path) -> dict[str, float]:
    peaks: dict[str, float] = {}
    for m in read_jsonl(run_dir / "metrics.jsonl"):
        peaks[m["region"]] = max(peaks.get(m["region"], 0.0), m["rss_mb"])
    return peaks


def _undisturbed(run: BackgroundRun) -> tuple[dict, dict[str, float]]:
    summary = run.join(timeout_s=240)
    assert run.error is None, run.error
    return summary, _rss_peaks(run.run_dir)


def _attack(run: BackgroundRun, done: threading.Event, told: dict) -> None:
    """The compromised peer's program: each step aims at the round the run is about to play."""
    atk = HostilePeer(run.runner.addresses[TARGET], tls_dir=run.run_dir / "tls", as_region=INSIDER, target=TARGET)

    def ahead() -> int:
        return run.runner.next_round + 1

    try:
        for _ in range(3):  # 3e38 in the insider's name, before the insider pushes that round
            atk.push_huge(ahead(), SHAPES, codec="bf16")  # bf16 holds 3e38 in the size of the run's fp16
            time.sleep(0.2)
        # A plausible update for the insider's next round, before the insider's own: on main it was
        # used and the insider's real one refused as a replay.
        plausible = encode_update("fp16", [torch.zeros(s) for s in SHAPES])
        # Rounds are short: until it lands in an open round. On a loaded CI host ten pushes in a row
        # were all refused `busy` (the insider's own pushes in flight) or out of the window: keep
        # trying for a few seconds, a little apart.
        for _ in range(100):
            if atk.push(ahead(), plausible) in ("accepted", "equivocation"):
                break
            time.sleep(0.05)
        atk.push_garbage(ahead() + 1000)  # far in the future
        told["flood"] = atk.fetch_flood(70, hold_s=2.0)
        stalled = [threading.Thread(target=atk.push_stalled, args=(ahead(), size),
                                    kwargs={"send_bytes": 1 << 20 if size > 1 << 20 else 0, "hold_s": 3.0})
                   for size in (1 << 30, 1 << 30, 1 << 20)]  # 1 GiB (main's cap), and this run's cap
        for th in stalled:
            th.start()
        for th in stalled:
            th.join(60)
        told["outcomes"] = dict(atk.outcomes)
        told["round_done"] = run.runner.next_round
    finally:
        atk.close()
        done.set()


def test_a_run_survives_a_compromised_peer(tmp_path):
    # The undisturbed run of the same seed runs beside the attacked one (the session's Ray has room
    # for both): ~22 s of the suite's wall time instead of a run of its own first. Its accuracy and
    # peaks do not depend on the load (fixed H, deadlines far above a round's time).
    reference = BackgroundRun(_config(), tmp_path / "undisturbed").start()
    run = BackgroundRun(_config(), tmp_path / "attacked").start()
    run.wait_rounds(5, timeout_s=120)
    done, told = threading.Event(), {}
    attacker = threading.Thread(target=_attack, args=(run, done, told), daemon=True)
    attacker.start()
    summary = run.join(timeout_s=240)
    attacker.join(60)
    base_summary, base_peaks = _undisturbed(reference)
    assert done.is_set()
    assert run.error is None, run.error  # main: FloatingPointError, the run failed
    assert summary["rounds"] == ROUNDS
    assert told.get("outcomes"), "the attack did not run to its end"
    assert told["round_done"] < ROUNDS - 5, told  # ...while the run still had rounds to report it in

    # Accuracy at most 3 points below the undisturbed run of the same seed. One part of the attack
    # gets in by design: the insider's genuine certificate lets its forged all-zero update into the
    # target's round, so the attacked run's trajectory differs from the undisturbed one. Measured on
    # 2026-12-03 (8 attacked runs, seed 0, 450 test images, undisturbed 0.9644 every time): 0.9467
    # (twice, one of them a CI failure of the old 1-point bound), 0.9622 (twice), 0.9733, 0.9756 and
    # two passes of the old bound. An attack that hurt would show far past 3 points: 3e38 accepted
    # is a non-finite model or a FloatingPointError (main), a refused insider is its data gone.
    assert summary["eval"]["value"] >= base_summary["eval"]["value"] - 0.03, (summary["eval"], base_summary["eval"])

    # Every attack refused, counted by reason by the target, in summary.json and events.jsonl.
    by_reason = summary["refusals"]["by_reason"]
    assert by_reason.get("out_of_bounds", 0) >= 1, by_reason   # 3e38
    # The insider's slot, taken first: the insider's own update is refused as an equivocation, or
    # as late when the forged one completed the target's round before it arrived (a fresh-clone CI
    # run: accepted forgery, then `late`); either way never as a replay, and the run survives.
    assert by_reason.get("equivocation", 0) + by_reason.get("late", 0) >= 1, by_reason
    assert by_reason.get("replayed", 0) == 0, by_reason        # main: the real insider was refused so
    assert by_reason.get("future_round", 0) >= 1, by_reason
    assert by_reason.get("busy", 0) >= 69, by_reason           # 70 unread FetchState streams: one held
    assert told["flood"].count("held") <= 1, told["flood"]
    assert by_reason.get("oversize", 0) >= 2, by_reason        # 1 GiB declared: refused before a byte
    assert "resource_exhausted" not in told["outcomes"], told["outcomes"]  # gRPC core never had to refuse
    logged = {}
    for e in events(run.run_dir, "refused"):
        if e["region"] == TARGET:
            for reason, n in e["by_reason"].items():
                logged[reason] = logged.get(reason, 0) + n
    assert logged.get("out_of_bounds", 0) >= 1 and logged.get("busy", 0) >= 69, logged

    # Memory: no region above 1.5x its undisturbed peak.
    peaks = _rss_peaks(run.run_dir)
    for region in REGIONS:
        assert peaks[region] <= 1.5 * base_peaks[region], (region, peaks[region], base_peaks[region])
