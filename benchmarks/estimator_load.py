"""Link estimates of the default run under CPU load: per link, the final estimate over what it delivers.

    python benchmarks/estimator_load.py --reps 3 --rounds 120 --load-after 3 --load-s 20

Each repetition runs `geofed run --set run.rounds=N` (the default config, configs/local-wan.yaml,
emulated AWS links) and, once training has run `--load-after` seconds (the first round in
rounds.jsonl), starts one busy loop per core for `--load-s` seconds (processes this script owns
and stops by pid). It then prints, per link, the last round's `bandwidth_mbps` against the
configured rate and the emulator's measured goodput, with the estimate's age and confidence, and
the host's load average at the start and end (other people's jobs count as load too).
The target (issue 37): every final estimate within 25% of what the link delivers, which is the
configured rate or the emulator's measured goodput (`emulator_goodput_mbps`): on a busy host the
emulator itself may deliver less than it was told. A link counts as within when it is within 25%
of either, and both tallies are printed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _spin() -> None:
    while True:
        pass


def _rounds(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a line still being written
    return out


def one_run(rounds: int, load_after: float, load_s: float, out: Path, extra: list[str]) -> dict:
    geofed = shutil.which("geofed") or str(Path(sys.executable).with_name("geofed"))
    cmd = [geofed, "run", "--set", f"run.rounds={rounds}", "--out", str(out), "--no-report", "--quiet", *extra]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    load_start = load_end = None
    spinners: list[multiprocessing.Process] = []
    load_at_round = unload_at_round = None
    try:
        while proc.poll() is None:
            time.sleep(0.25)
            recs = _rounds(out / "rounds.jsonl")
            now = time.monotonic()
            if load_start is None and recs:
                load_start = now + load_after
            if load_start is not None and not spinners and now >= load_start and load_end is None:
                spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 2)]
                for s in spinners:
                    s.start()
                load_at_round = len(recs)
            if spinners and now >= load_start + load_s:
                for s in spinners:
                    s.kill()  # our own processes, by their handle
                    s.join()
                spinners, load_end = [], now
                unload_at_round = len(_rounds(out / "rounds.jsonl"))
        _, err = proc.communicate()
    finally:
        for s in spinners:
            s.kill()
            s.join()
    recs = _rounds(out / "rounds.jsonl")
    if proc.returncode != 0 or not recs:
        raise SystemExit(f"run failed (exit {proc.returncode}): {err[-2000:]}")
    last = recs[-1]
    links = {}
    for link, e in sorted(last.get("links", {}).items()):
        est, conf, good = e.get("bandwidth_mbps"), e.get("configured_bandwidth_mbps"), e.get("emulator_goodput_mbps")
        links[link] = {"estimate_mbps": est, "configured_mbps": conf, "goodput_mbps": good,
                       "ratio_configured": None if not (est and conf) else round(est / conf, 3),
                       "ratio_goodput": None if not (est and good) else round(est / good, 3),
                       "age_s": e.get("age_s"), "confidence": e.get("confidence")}
    reprobe = update = reprobes = 0
    verdicts: dict[str, int] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        for t in json.loads(line).get("transfers", []):
            if t["direction"] == "probe" and t.get("reprobe"):
                reprobe += t["bytes"]
                reprobes += bool(t.get("measured"))  # a re-probe is two probes; the measured one counts it
                if t.get("measured"):
                    verdicts[t.get("verdict", "?")] = verdicts.get(t.get("verdict", "?"), 0) + 1
            elif t["direction"] == "send":
                update += t["bytes"]
    return {"wall_s": round(time.monotonic() - t0, 1), "rounds": len(recs),
            "reprobe_mb": round(reprobe / 1e6, 2), "update_mb": round(update / 1e6, 2), "reprobes": reprobes,
            "reprobe_verdicts": verdicts,
            "load_rounds": [load_at_round, unload_at_round],
            "training_s": round(recs[-1]["t_end"] - recs[0]["t_start"], 1) if recs[0].get("t_start") is not None else None,
            "links": links}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=120)
    ap.add_argument("--load-after", type=float, default=3.0, help="seconds of training before the busy loops")
    ap.add_argument("--load-s", type=float, default=20.0, help="how long the busy loops run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="more --set overrides for geofed run")
    ap.add_argument("--keep", type=Path, help="keep the run directories under this folder (default: deleted)")
    args = ap.parse_args(argv)
    extra = [x for s in args.set for x in ("--set", s)]
    results = []
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="geofed-estload-", dir=args.keep) as tmp:
        if args.keep:
            tmp = tempfile.mkdtemp(prefix="runs-", dir=args.keep)
        for rep in range(args.reps):
            la0 = os.getloadavg()[0]
            for attempt in range(3):  # a run that fails to start on a shared, overloaded host is tried again
                try:
                    res = one_run(args.rounds, args.load_after, args.load_s, Path(tmp) / f"run{rep}-{attempt}", extra)
                    break
                except SystemExit as exc:
                    print(f"rep {rep} attempt {attempt}: {str(exc)[-300:]}", file=sys.stderr)
                    time.sleep(20)
            else:
                raise SystemExit(f"rep {rep}: every attempt failed")
            res["loadavg_start"], res["loadavg_end"] = round(la0, 2), round(os.getloadavg()[0], 2)
            results.append(res)
            if not args.json:
                print(f"rep {rep}: {res['rounds']} rounds, {res['training_s']} s training, load from round "
                      f"{res['load_rounds'][0]} to {res['load_rounds'][1]}, load average {res['loadavg_start']} -> "
                      f"{res['loadavg_end']}; re-probes {res['reprobe_mb']} MB ({res['reprobes']}: {res['reprobe_verdicts']}), "
                      f"updates {res['update_mb']} MB")
                print("| link | estimate Mbit/s | configured | goodput | est/configured | est/goodput | age s | confidence |")
                print("|---|---|---|---|---|---|---|---|")
                for link, e in res["links"].items():
                    print(f"| {link} | {e['estimate_mbps']} | {e['configured_mbps']} | {e['goodput_mbps']} | "
                          f"{e['ratio_configured']} | {e['ratio_goodput']} | {e['age_s']} | {e['confidence']} |")
                sys.stdout.flush()
    links = [e for r in results for e in r["links"].values() if e["ratio_configured"]]
    ratios = [e["ratio_configured"] for e in links]

    def near(x: float | None) -> bool:
        return x is not None and abs(x - 1) <= 0.25

    within_conf = sum(near(e["ratio_configured"]) for e in links)
    within_good = sum(near(e["ratio_goodput"]) for e in links)
    within = sum(near(e["ratio_configured"]) or near(e["ratio_goodput"]) for e in links)
    if args.json:
        print(json.dumps({"runs": results, "within_25pct": within, "within_25pct_configured": within_conf,
                          "within_25pct_goodput": within_good, "links": len(links)}, indent=1))
    else:
        good = [e["ratio_goodput"] for e in links if e["ratio_goodput"]]
        print(f"within 25% of what the link delivers (configured or goodput): {within} of {len(links)} link-runs; "
              f"of configured: {within_conf}, of goodput: {within_good}")
        print(f"est/configured median {statistics.median(ratios) if ratios else None}, min {min(ratios, default=None)}, "
              f"max {max(ratios, default=None)}; est/goodput median {statistics.median(good) if good else None}, "
              f"min {min(good, default=None)}, max {max(good, default=None)}")
    return 0 if within == len(links) else 1


if __name__ == "__main__":
    sys.exit(main())
