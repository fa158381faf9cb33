"""`geofed bench memory`: a region's peak memory per parameter, against the 32 B/param floor (issue 39).

    geofed bench memory [--sizes 1M,10M] [--arms serial,delayed,...] [--rounds N] [--H N] [--json] [--out DIR] [--keep]

Every (size, arm) is one real `geofed run` (Ray actors, mutual-TLS gRPC on loopback, no WAN
emulation) of 2 regions training the `gpt` task (tinyshakespeare, byte tokens, context 256,
batch 4) with DiLoCo, int8 updates with error feedback and a fixed H, for --rounds rounds.

Sizes (``task.n_layer`` x ``task.d_model``): 1M (5 x 128), 10M (6 x 384), 30M (6 x 640, the issue's
29.8M) and 100M (12 x 832). Arms: ``serial`` (sync.overlap false), ``delayed`` (overlap true),
``eager``, ``fragments`` (4 fragments, eager), ``gossip`` (sync.algorithm gossip: CHOCO, so no error
feedback), ``secagg`` (serial, security.secure_aggregation with 8-bit masks: no overlap; 3 regions: it needs 3), ``checkpoint``
(delayed, run.checkpoint_every 1), ``no-rollback`` (delayed, security.rollback_on_nonfinite false: no copy of
each round's start), ``rollback-memory`` (delayed, security.rollback_copy memory: the copy in the process, not in a
file), ``recompute`` (delayed, task.activation_checkpointing), ``step-after`` (delayed,
sync.inner.step_in_backward false: the inner step after the backward pass), ``recompute-step-after`` (both)
and ``export`` (delayed, up to the run's end).

How it is measured, without a line in the regions' code: while a run goes, a thread reads each
region process's high-water mark of resident memory (VmHWM in /proc/PID/status, the kernel's own
peak; the pids are in the run's events.jsonl "started" event) ten times a second. An arm's peak
is the largest VmHWM of its regions when the run's last round is logged (rounds.jsonl); ``export``
takes it at the run's end instead, after what every run does last: a checkpoint, an evaluation,
the model fetched from a region and written (model.safetensors). The baseline is the VmHWM of an
idle Ray actor that imported torch and built nothing. bytes_per_param = (peak - baseline) / params.
A GPU's torch.cuda.max_memory_allocated can only be read inside the region's process: that needs
a field in the region's report (docs/bench-memory.md), so this bench measures host memory alone.

Progress goes to stderr; --json prints {"floor_bytes_per_param": 32, "rows": [{"arm", "params",
"peak_rss_bytes", "baseline_rss_bytes", "bytes_per_param", "size"}], "failed": [{"arm", "size",
"error"}]}: a run that fails is named there (and the exit code is 1), the other arms still run.
Each run's checkpoints and exported model are deleted once it is measured (--keep keeps them); its
logs stay under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from geofed.orchestrator.config import config_from_mapping

FLOOR_BYTES_PER_PARAM = 32  # DiLoCo in fp32 with AdamW, EF and one pseudo-gradient in flight (issue 39)
REGIONS = ["us-east-1", "eu-west-1"]
# size -> (n_layer, n_head, d_model)
SIZES: dict[str, tuple[int, int, int]] = {"1M": (5, 4, 128), "10M": (6, 6, 384), "30M": (6, 8, 640),
                                          "100M": (12, 8, 832)}
# arm -> (config sections over the base, where the peak is taken: "rounds" or "end")
ARMS: dict[str, tuple[dict[str, Any], str]] = {
    "serial": ({"sync": {"overlap": False}}, "rounds"),
    "delayed": ({"sync": {"overlap": True}}, "rounds"),
    "eager": ({"sync": {"overlap": "eager"}}, "rounds"),
    "fragments": ({"sync": {"overlap": "eager", "fragments": 4}}, "rounds"),
    "gossip": ({"sync": {"algorithm": "gossip"}, "compression": {"error_feedback": False}}, "rounds"),  # CHOCO's rule
    # secure aggregation needs 3 regions (with 2, the sum gives the other's update away)
    # secagg_bits 8: with the default 32 the masked update (4 B/value) outgrows the transport's
    # max_message_bytes, sized from int8 (regions/limits.py), and round 1 fails
    "secagg": ({"sync": {"overlap": False}, "security": {"secure_aggregation": True, "secagg_bits": 8},
                "regions": {"names": [*REGIONS, "ap-northeast-1"]}}, "rounds"),
    "checkpoint": ({"sync": {"overlap": True}, "run": {"checkpoint_every": 1}}, "rounds"),
    # delayed without rollback's copy of every round's start (model, AdamW, outer state: 20 B/param),
    # which the 32 B/param floor does not count
    "no-rollback": ({"sync": {"overlap": True}, "security": {"rollback_on_nonfinite": False}}, "rounds"),
    # delayed with rollback's copy held in the process (security.rollback_copy memory; disk is the default)
    "rollback-memory": ({"sync": {"overlap": True}, "security": {"rollback_copy": "memory"}}, "rounds"),
    # delayed with each gpt block recomputed in the backward pass (activations of about one block)
    "recompute": ({"sync": {"overlap": True}, "task": {"activation_checkpointing": True}}, "rounds"),
    # delayed with the outer state in host memory (sync.outer.offload): on a CPU region the same buffers
    # (it moves nothing off a CPU model); on a GPU it is offload_cuda_check's to measure
    "offload": ({"sync": {"overlap": True, "outer": {"offload": True}}}, "rounds"),
    # delayed with the inner step after the backward pass (sync.inner.step_in_backward false: every
    # gradient alive at once before the step), as before the step moved into the backward pass
    "step-after": ({"sync": {"overlap": True, "inner": {"kind": "adamw", "lr": 0.001, "batch_size": 4,
                                                        "step_in_backward": False}}}, "rounds"),
    # recompute with the inner step after the backward pass: where the gradients, not the activations,
    # set the step's peak
    "recompute-step-after": ({"sync": {"overlap": True, "inner": {"kind": "adamw", "lr": 0.001, "batch_size": 4,
                                                                  "step_in_backward": False}},
                              "task": {"activation_checkpointing": True}}, "rounds"),
    "export": ({"sync": {"overlap": True}}, "end"),
}
POLL_S = 0.1


def arm_config(arm: str, size: str, *, rounds: int, H: int, seed: int = 0,
               extra: dict[str, dict[str, Any]] | None = None):
    """The run config of one arm at one size (`extra`: sections merged over the arm's)."""
    n_layer, n_head, d_model = SIZES[size]
    sections, _ = ARMS[arm]
    m: dict[str, Any] = {
        "run": {"name": f"bench-memory-{size.lower()}-{arm}", "rounds": rounds, "seed": seed, "eval_every": 0,
                "checkpoint_every": 0, "report": False},
        "task": {"kind": "gpt", "dataset": "tinyshakespeare", "n_layer": n_layer, "n_head": n_head,
                 "d_model": d_model, "context": 256},
        "regions": {"names": REGIONS, "num_cpus": 0.5},
        "network": {"emulation": {"mode": "none"}},
        "compression": {"codec": "int8", "error_feedback": True},
        "sync": {"policy": {"kind": "fixed", "H": H}, "inner": {"kind": "adamw", "lr": 0.001, "batch_size": 4}},
    }
    for more in (sections, extra or {}):
        for key, part in more.items():
            m[key] = {**m.get(key, {}), **part}
    return config_from_mapping(m)


def offload_cuda_check(size: str = "10M", *, rounds: int = 3, H: int = 2, out: Path | None = None) -> dict[str, Any]:
    """On a GPU: the delayed arm at `size`, its 2 regions in this process (regions/inprocess.py) on
    cuda:0, once without and once with sync.outer.offload: torch.cuda.max_memory_allocated of each
    (both regions: per region is half), per parameter, and every model-sized buffer whose device is
    not the one its Diloco's placement says (an empty list where all are). RuntimeError without CUDA."""
    import tempfile

    import torch

    from geofed.regions.inprocess import InProcessRegions
    from geofed.regions.messages import RoundPlan

    if not torch.cuda.is_available():
        raise RuntimeError("offload_cuda_check needs CUDA: torch.cuda.is_available() is False")
    rows = []
    for offload in (False, True):
        cfg = arm_config("offload" if offload else "delayed", size, rounds=rounds, H=H,
                         extra={"regions": {"device": "cuda:0", "num_gpus": 0.5}})
        params = count_params(cfg)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with tempfile.TemporaryDirectory(dir=out) as tmp, InProcessRegions(cfg, tmp) as group:
            for r in range(rounds):
                group.run_round({reg: RoundPlan(round=r, H=H, final=r == rounds - 1) for reg in group.regions})
            misplaced = [f"{reg}: {name} on {t.device} (pinned {t.is_pinned()}), placement {part.placement}"
                         for reg, w in group.workers.items() for part in w.algorithm.parts
                         for name, ts in part.outer_buffers().items() for t in ts
                         if t.device != part.placement.device or t.is_pinned() != part.placement.pin]
            peak = torch.cuda.max_memory_allocated() - base
        rows.append({"offload": offload, "params": params, "cuda_max_allocated_bytes": peak,
                     "device_bytes_per_param_per_region": round(peak / len(cfg.regions.names) / params, 2),
                     "misplaced": misplaced})
    return {"size": size, "rounds": rounds, "H": H, "rows": rows}


def count_params(cfg: Any) -> int:
    """Trainable parameters of the task's model, built on the meta device (no memory, no data)."""
    import torch

    from geofed.regions.tasks.gpt import GPT

    with torch.device("meta"):
        model = GPT(256, cfg.task)  # byte tokens
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def vm_hwm(pid: int) -> int | None:
    """The process's peak resident memory in bytes (VmHWM), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _region_pids(run_dir: Path) -> dict[str, int]:
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line being written
        if event.get("event") == "started":
            return {r: int(i["pid"]) for r, i in event["regions"].items() if i.get("pid")}
    return {}


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


class PeakWatch:
    """Reads the region processes' VmHWM while the run in `run_dir` goes."""

    def __init__(self, run_dir: Path, rounds: int):
        self.run_dir, self.rounds = run_dir, rounds
        self.peak: dict[str, int] = {}  # region -> VmHWM so far
        self.at_last_round: dict[str, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-memory-watch", daemon=True)

    def __enter__(self) -> PeakWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        run_dir, pids = self.run_dir, {}
        while not self._stop.wait(POLL_S):
            pids = pids or _region_pids(run_dir)
            for region, pid in pids.items():
                hwm = vm_hwm(pid)
                if hwm is not None:
                    self.peak[region] = max(self.peak.get(region, 0), hwm)
            if self.at_last_round is None and pids and _lines(run_dir / "rounds.jsonl") >= self.rounds:
                self.at_last_round = dict(self.peak)


def idle_actor_baseline() -> int:
    """VmHWM of a Ray actor that imported torch (one thread) and built nothing."""
    import ray

    @ray.remote(num_cpus=0)
    class Idle:
        def hwm(self) -> int | None:
            import gc

            import torch

            torch.set_num_threads(1)
            gc.collect()
            return vm_hwm(os.getpid())

    actor = Idle.remote()  # type: ignore[attr-defined]
    try:
        got = ray.get(actor.hwm.remote(), timeout=300)
    finally:
        ray.kill(actor)
    if not got:
        raise RuntimeError("the idle actor could not read its own /proc/self/status (Linux only)")
    return int(got)


# What a measured run leaves that a 100M model makes gigabytes of: a run's checkpoints hold
# several copies of the model, and the export one more (a full bench once filled the disk to 93%).
_BULKY = ("checkpoints", "model.safetensors")


def drop_bulk(run_dir: Path) -> int:
    """Delete a measured run's checkpoints and exported model (its logs stay); the bytes freed."""
    freed = 0
    for name in _BULKY:
        path = run_dir / name
        if path.is_dir():
            freed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path)
        elif path.is_file():
            freed += path.stat().st_size
            path.unlink()
    return freed


def measure(arm: str, size: str, out: Path, *, rounds: int, H: int, params: int,
            baseline: int, cache: dict, keep: bool = False) -> dict[str, Any]:
    """One row: run the arm (or reuse the run of an arm with the same config) and read its peak."""
    from .runs import run_to_end

    sections, where = ARMS[arm]
    key = json.dumps(sections, sort_keys=True)
    if key not in cache:
        cfg = arm_config(arm, size, rounds=rounds, H=H)
        with PeakWatch(out / arm, rounds) as watch:
            run_to_end(cfg, out / arm, source="bench memory")
        if not keep:
            drop_bulk(out / arm)
        cache[key] = watch
    watch = cache[key]
    peaks = watch.peak if where == "end" else watch.at_last_round
    if not peaks:
        raise RuntimeError(f"{size} {arm}: no region memory was read (no pids in events.jsonl, or no rounds logged)")
    peak = max(peaks.values())
    return {"arm": arm, "size": size, "params": params, "peak_rss_bytes": peak, "baseline_rss_bytes": baseline,
            "bytes_per_param": round((peak - baseline) / params, 2)}


def run_bench(out: Path, *, sizes: Sequence[str], arms: Sequence[str], rounds: int, H: int,
              keep: bool = False) -> dict[str, Any]:
    """Every arm at every size; returns the JSON document (also out/bench.json). Each run's
    checkpoints and export are deleted once it is measured, unless `keep`."""
    from geofed.orchestrator.driver.cluster import PlacementError
    from geofed.orchestrator.driver.recovery import RunFailed

    from .runs import bench_ray

    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    first = arm_config(arms[0], sizes[0], rounds=rounds, H=H)
    with bench_ray(first):
        baseline = idle_actor_baseline()
        print(f"geofed bench memory: idle actor (torch imported) {baseline / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        for size in sizes:
            params = count_params(arm_config(arms[0], size, rounds=rounds, H=H))
            cache: dict = {}
            for arm in arms:
                try:
                    row = measure(arm, size, out / size, rounds=rounds, H=H, params=params, baseline=baseline, cache=cache,
                                  keep=keep)
                except (PlacementError, RunFailed, RuntimeError) as exc:  # one arm's failure leaves the others' rows
                    failed.append({"arm": arm, "size": size, "error": str(exc)})
                    print(f"geofed bench memory: {size} {arm} FAILED: {exc}", file=sys.stderr, flush=True)
                    continue
                rows.append(row)
                print(f"geofed bench memory: {size} ({params:,} params) {arm}: peak {row['peak_rss_bytes'] / 2**20:.0f} MiB,"
                      f" {row['bytes_per_param']} B/param", file=sys.stderr, flush=True)
    doc = {"floor_bytes_per_param": FLOOR_BYTES_PER_PARAM, "rounds": rounds, "H": H, "rows": rows, "failed": failed}
    (out / "bench.json").write_text(json.dumps(doc, indent=1))
    return doc


def _print_table(doc: dict[str, Any]) -> None:
    floor = doc["floor_bytes_per_param"]
    print(f"{'size':>5} {'params':>12} {'arm':<11} {'peak MiB':>9} {'B/param':>8} {'x floor':>8}")
    for r in doc["rows"]:
        bpp = r["bytes_per_param"]
        print(f"{r['size']:>5} {r['params']:>12,} {r['arm']:<11} {r['peak_rss_bytes'] / 2**20:>9.0f} {bpp:>8.1f}"
              f" {bpp / floor:>8.2f}")
    print(f"peak RSS of the largest region minus an idle actor's ({doc['rows'][0]['baseline_rss_bytes'] / 2**20:.0f} MiB),"
          f" per parameter; floor {floor} B/param")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="geofed bench memory", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,10M", help=f"comma-separated subset of {', '.join(SIZES)} (default 1M,10M)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)} (default: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--H", type=int, default=2, help="inner steps per round (fixed policy)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--out", help="run directories (default runs/bench-memory-<UTC time>)")
    ap.add_argument("--keep", action="store_true",
                    help="keep each run's checkpoints and exported model (deleted once measured by default: "
                         "at 100M they are gigabytes per arm)")
    return ap


def _pick(text: str, known: Sequence[str], what: str) -> list[str]:
    picked = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in picked if s not in known]
    if unknown or not picked:
        raise ValueError(f"--{what}: unknown {', '.join(unknown) or '(none given)'} (known: {', '.join(known)})")
    return list(dict.fromkeys(picked))


def main(argv: Sequence[str]) -> int:
    """`geofed bench memory ARGS`; returns the exit code (2: bad arguments, 1: a run failed)."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        sizes, arms = _pick(args.sizes, list(SIZES), "sizes"), _pick(args.arms, list(ARMS), "arms")
        if args.rounds < 1 or args.H < 1:
            raise ValueError("--rounds and --H must be >= 1")
    except ValueError as exc:
        print(f"geofed bench memory: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/bench-memory-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}")
    doc = run_bench(out, sizes=sizes, arms=arms, rounds=args.rounds, H=args.H, keep=args.keep)
    if args.json:
        print(json.dumps({k: doc[k] for k in ("floor_bytes_per_param", "rows", "failed")}, indent=1))
    elif doc["rows"]:
        _print_table(doc)
    if doc["failed"]:
        print(f"geofed bench memory: {len(doc['failed'])} run(s) failed (run directories: {out})", file=sys.stderr)
    return 1 if doc["failed"] else 0


__all__ = ["ARMS", "FLOOR_BYTES_PER_PARAM", "SIZES", "arm_config", "count_params", "drop_bulk", "main",
           "offload_cuda_check", "run_bench", "vm_hwm"]
