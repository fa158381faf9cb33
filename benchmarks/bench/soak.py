"""`geofed bench soak`: a real run with a hostile peer inside it, for as long as you like.

    geofed bench soak [--minutes 30] [--rate 10] [--json] [--out DIR] [--set KEY=VALUE ...]

A run of the digits task (3 regions, DiLoCo over mutual-TLS gRPC, in this process's Ray) trains
while a compromised peer (geofed.bench.hostile_peer.HostilePeer, holding the second region's genuine
certificate from the run's tls/ folder) calls the first region's server ``--rate`` times a second,
in turn: a garbage payload, an update of huge finite values, a FetchState flood (a handful of
streams held unread), a far-future round, a header declaring 1 GiB, and a slow-loris push that
declares the largest size it may and stalls. When the time is up the run finishes normally.

It reports whether the run finished, the refusals by reason (the regions' own counts, summary.json),
what the attacker was told, and each region's resident-memory slope in MB/min after the warm-up
(a least-squares line through metrics.jsonl's rss_mb over time); the target is under 1 MB/min.
Exit code 0 when the run finished and every slope is under the target, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .hostile_peer import HostilePeer

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.orchestrator.driver.run import Runner

SLOPE_TARGET_MB_PER_MIN = 1.0
REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1"]
TARGET, INSIDER = REGIONS[0], REGIONS[1]
SHAPES = [(32, 64), (32,), (10, 32), (10,)]  # the digits MLP with 32 hidden units


def soak_config(overrides: Sequence[str] = ()) -> Any:
    """The soak run's config: the digits task on 3 regions without emulation, rounds without end (time ends it),
    then `overrides`."""
    return config_from_mapping({
        "run": {"name": "soak", "rounds": 10_000_000, "report": False, "checkpoint_every": 50, "seed": 0},
        "task": {"kind": "mlp-digits", "hidden": 32},
        "regions": {"names": REGIONS, "num_cpus": 0.5},
        "network": {"emulation": {"mode": "none"}},
        "sync": {"policy": {"kind": "fixed", "H": 10}, "inner": {"lr": 0.01},
                 "deadline": {"initial_s": 3.0, "min_s": 0.5, "max_s": 4.0}},
    }, list(overrides), source="geofed bench soak")


class _TimedRunner(Runner):
    """Ends the run normally (final checkpoint, evaluation, summary) once `seconds` have passed."""

    def __init__(self, *args, seconds: float, **kw):
        super().__init__(*args, **kw)
        self.seconds = seconds

    def _round(self, r: int) -> None:
        super()._round(r)
        if self.clock.now() >= self.seconds:
            # The loop ends a run whose step budget is spent: make it so, the run finishes as usual.
            self.coordinator.max_steps = max(1, self.coordinator.steps_done)


class HostileLoop:
    """The attacks, in turn, `rate` per second, against the round the run is about to play."""

    def __init__(self, peer: HostilePeer, runner: Runner, *, rate: float):
        self.peer, self.runner, self.rate = peer, runner, rate
        self.stop = threading.Event()
        self.actions: Counter[str] = Counter()
        self._stalled: list[threading.Thread] = []

    def _round(self) -> int:
        return self.runner.next_round + 1

    def _one(self, i: int) -> None:
        p, r = self.peer, self._round()
        kind = ("garbage", "huge", "fetch_flood", "future", "oversize", "stalled")[i % 6]
        self.actions[kind] += 1
        if kind == "garbage":
            p.push_garbage(r)
        elif kind == "huge":
            p.push_huge(r, SHAPES)
        elif kind == "fetch_flood":
            p.fetch_flood(5, hold_s=0.05, timeout_s=10)
        elif kind == "future":
            p.push_garbage(r + 10_000)
        elif kind == "oversize":
            p.push_stalled(r, 1 << 30, send_bytes=0, hold_s=0.0)
        elif not any(t.is_alive() for t in self._stalled):  # one slow-loris at a time, held 5 s
            th = threading.Thread(target=p.push_stalled, args=(r, 1 << 20),
                                  kwargs={"send_bytes": 64 << 10, "hold_s": 5.0}, daemon=True)
            th.start()
            self._stalled = [th]

    def run(self) -> None:
        i = 0
        start = time.monotonic()
        while not self.stop.is_set():
            try:
                self._one(i)
            except Exception as exc:  # noqa: BLE001 - an attack that fails to run is counted, not fatal
                self.peer.outcomes[f"attack error: {type(exc).__name__}"] += 1
            i += 1
            self.stop.wait(max(0.0, start + i / self.rate - time.monotonic()))
        for th in self._stalled:
            th.join(30)


def rss_slopes(run_dir: Path, *, warmup_s: float) -> dict[str, dict[str, float]]:
    """Per region: MB/min of a least-squares line through rss_mb after `warmup_s`, and first/last/peak."""
    out = {}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    for region in sorted({m["region"] for m in metrics}):
        pts = [(m["t_end"], m["rss_mb"]) for m in metrics if m["region"] == region and m["t_end"] >= warmup_s]
        if len(pts) < 3:
            out[region] = {"slope_mb_per_min": float("nan"), "samples": len(pts)}
            continue
        n = len(pts)
        mt, mr = sum(t for t, _ in pts) / n, sum(r for _, r in pts) / n
        var = sum((t - mt) ** 2 for t, _ in pts)
        slope = sum((t - mt) * (r - mr) for t, r in pts) / var * 60 if var else 0.0
        every = [m["rss_mb"] for m in metrics if m["region"] == region]
        out[region] = {"slope_mb_per_min": round(slope, 3), "samples": n, "rss_first_mb": pts[0][1],
                       "rss_last_mb": pts[-1][1], "rss_peak_mb": max(every)}
    return out


def soak(minutes: float, *, rate: float, out: Path, overrides: Sequence[str] = (), log=print) -> dict[str, Any]:
    """Run the soak for `minutes` with the hostile peer attacking at `rate` calls a second; returns
    the result (finished, refusals, what the attacker was told, each region's memory trend).
    """
    cfg = soak_config(overrides)
    out.mkdir(parents=True)
    runner = _TimedRunner(cfg, out, show_progress=False, seconds=minutes * 60)
    result: dict[str, Any] = {"summary": None, "error": None}

    def main():
        try:
            result["summary"] = runner.run()
        except BaseException as exc:  # noqa: BLE001 - reported
            result["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=main, name="geofed-soak-run", daemon=True)
    thread.start()
    while runner.next_round < 3 and thread.is_alive():  # the run is up and its servers serve
        time.sleep(0.2)
    loop = None
    if thread.is_alive():
        peer = HostilePeer(runner.addresses[TARGET], tls_dir=out / "tls", as_region=INSIDER, target=TARGET)
        loop = HostileLoop(peer, runner, rate=rate)
        attacker = threading.Thread(target=loop.run, name="geofed-soak-attacker", daemon=True)
        attacker.start()
        t0 = time.monotonic()
        while thread.is_alive():
            thread.join(60)
            log(f"soak: {time.monotonic() - t0:.0f} s, round {runner.next_round}, attacks {sum(loop.actions.values())}")
        loop.stop.set()
        attacker.join(60)
        peer.close()
    thread.join()
    runner.shutdown()
    warmup_s = min(300.0, minutes * 60 / 3)
    summary = result["summary"] or {}
    slopes = rss_slopes(out, warmup_s=warmup_s)
    return {
        "minutes": minutes, "rate_per_s": rate, "run_dir": str(out), "finished": result["summary"] is not None,
        "error": result["error"], "rounds": summary.get("rounds"), "eval": summary.get("eval"),
        "refusals_by_reason": summary.get("refusals", {}).get("by_reason", {}),
        "refusals_by_region": summary.get("refusals", {}).get("by_region", {}),
        "attacks": dict(loop.actions) if loop else {}, "attacker_was_told": dict(loop.peer.outcomes) if loop else {},
        "warmup_s": warmup_s, "rss": slopes, "slope_target_mb_per_min": SLOPE_TARGET_MB_PER_MIN,
        "faults": summary.get("faults", {}),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geofed bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="how long the run trains under attack (default 30)")
    p.add_argument("--rate", type=float, default=10.0, help="attacks per second (default 10)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress on stderr)")
    p.add_argument("--out", help="run directory (default runs/bench-soak-<UTC time>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a key of the soak's run config")
    return p


def main(argv: Sequence[str]) -> int:
    """`geofed bench soak ARGS`; returns 0 when the run finished and no region's memory grew past the target, else 1."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    if not args.minutes > 0 or not args.rate > 0:
        print("geofed bench soak: --minutes and --rate must be > 0", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/bench-soak-{datetime.now(UTC):%Y%m%dT%H%M%SZ}")
    res = soak(args.minutes, rate=args.rate, out=out, overrides=args.overrides,
               log=lambda s: print(s, file=sys.stderr))
    ok = res["finished"] and all(r.get("slope_mb_per_min", 99) < SLOPE_TARGET_MB_PER_MIN for r in res["rss"].values())
    res["ok"] = ok
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        _print(res)
    return 0 if ok else 1


def _print(res: dict[str, Any]) -> None:
    print(f"soak: {res['minutes']:g} min at {res['rate_per_s']:g} attacks/s -> run {'finished' if res['finished'] else 'FAILED: ' + str(res['error'])}"
          f" ({res['rounds']} rounds, {res['eval']})")
    print("refusals by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(res["refusals_by_reason"].items())))
    print("the attacker was told: " + ", ".join(f"{k} {v}" for k, v in sorted(res["attacker_was_told"].items())))
    print(f"resident memory after a {res['warmup_s']:.0f} s warm-up (target < {res['slope_target_mb_per_min']} MB/min):")
    for region, r in res["rss"].items():
        print(f"  {region:16s} slope {r.get('slope_mb_per_min')} MB/min, first {r.get('rss_first_mb')} MB, "
              f"last {r.get('rss_last_mb')} MB, peak {r.get('rss_peak_mb')} MB ({r.get('samples')} rounds)")
    print(f"run directory: {res['run_dir']}")
