"""The GPU check: one prepared script, under 5 minutes on one GPU, that prints its figures as JSON.

    python benchmarks/gpu_check.py [--out DIR] [--max-steps 300] [--run-timeout 210] [--parts codecs,run,region,offload]

1. `geofed run configs/gpt-wan.yaml` with four regions sharing the one GPU
   (regions.device cuda, regions.num_gpus 0.25, sync.inner.precision bf16) on a bigger gpt
   (8 blocks, width 512, context 256: ~25M parameters) over the emulated AWS links; reports
   steps/s per region (inner steps over compute seconds, and over the run's wall time), the
   run's compute utilisation, each region's placement device, and the GPU's utilisation and
   memory sampled with nvidia-smi once a second.
2. The codecs on CUDA tensors (`geofed bench codecs` times host tensors only): each codec's
   encode_into/decode_into with the input and sections on the GPU, and the path a region takes
   today (`codec.encode` of a CUDA tensor: the copy to the host, then encoding there), in GB/s
   of fp32 input.

3. A region of two GPUs (issue 39, item 6), where the machine has two or more: two regions of
   `regions.workers` 2 each (four actors of `regions.num_gpus` 0.5: Ray packs fractional GPUs, and
   creates every region's worker 0 before the others, so worker 0s share one GPU and worker 1s
   the other, one GPU per worker of a region as NCCL needs), NCCL inside each region, mutual-TLS
   gRPC across, against the same run with one worker a region; reports each arm's examples/s per
   region (steps x batch x workers over compute seconds) and their ratio (2.0 would be linear).
   Where Ray placed both of a region's workers on one GPU, NCCL refuses the group and the arm's
   `error` says so.

4. `sync.outer.offload` on the GPU (issue 39, item 2): the delayed-overlap arm of `geofed bench
   memory` at 10M, two regions in this process on cuda:0, without and with offload
   (`geofed.bench.memory.offload_cuda_check`): `torch.cuda.max_memory_allocated` per region and
   parameter for each, and every model-sized buffer not on the device its placement says
   (`misplaced`, empty where all are).

Without CUDA it exits 2 at once, before anything starts. Needs tinyshakespeare in the data
cache (`geofed data fetch tinyshakespeare`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"task.n_layer": 8, "task.n_head": 8, "task.d_model": 512, "task.context": 256}
CODECS = ["fp16", "bf16", "int8", "int4", {"kind": "topk", "fraction": 0.01}]
PARTS = ("codecs", "run", "region", "offload")


def refuse_without_cuda() -> None:
    """Exit 2 with one line when this machine has no usable CUDA device."""
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda}); run it on a machine with a GPU",
              file=sys.stderr)
        raise SystemExit(2)


class GpuSampler(threading.Thread):
    """nvidia-smi's utilisation (mean over the GPUs) and memory (summed), once a second, while a run trains."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        smi = shutil.which("nvidia-smi")
        while smi and not self.stop.wait(1.0):
            try:
                out = subprocess.run([smi, "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                rows = [[float(v) for v in line.split(",")] for line in out.strip().splitlines()]
                # every GPU's: the mean utilisation, the memory summed (part 3 uses two)
                self.samples.append((sum(u for u, _ in rows) / len(rows), sum(m for _, m in rows)))
            except (ValueError, OSError, subprocess.TimeoutExpired):
                continue

    def summary(self) -> dict:
        if not self.samples:
            return {"samples": 0}
        util = [u for u, _ in self.samples]
        busy = [u for u in util if u > 0]
        return {"samples": len(util), "util_mean_pct": sum(util) / len(util),
                "util_mean_while_busy_pct": sum(busy) / len(busy) if busy else 0.0,
                "memory_max_mib": max(m for _, m in self.samples)}


def run_regions(out: Path, max_steps: int, timeout_s: float) -> dict:
    """Four regions on one GPU over the emulated WAN; figures from the run's own records."""
    sets = {"regions.device": "cuda", "regions.num_gpus": 0.25, "regions.num_cpus": 1, "sync.inner.precision": "bf16",
            "sync.inner.batch_size": 32, "run.max_steps": max_steps, "network.emulation.bandwidth_scale": 1.0, **MODEL}
    return geofed_run(out, sets, timeout_s)


def region_sets(workers: int, max_steps: int) -> dict:
    """The two-GPU part's overrides for one arm: two regions of `workers` workers, half a GPU each."""
    return {"regions.names": "[us-east-1,eu-west-1]", "regions.workers": workers, "regions.device": "cuda",
            "regions.num_gpus": 0.5, "regions.num_cpus": 1, "sync.inner.precision": "bf16",
            "sync.inner.batch_size": 32, "run.max_steps": max_steps, "network.emulation.bandwidth_scale": 1.0, **MODEL}


def run_region_of_two(out: Path, max_steps: int, timeout_s: float) -> dict:
    """Part 3: two regions of two GPU workers each against one worker each (module docstring)."""
    have = torch.cuda.device_count()
    if have < 2:
        return {"skipped": f"needs 2 CUDA devices, this machine has {have}"}
    arms = {}
    for workers in (1, 2):
        sets = region_sets(workers, max_steps)
        res = geofed_run(out / f"workers{workers}", sets, timeout_s)
        for r in res.get("regions", {}).values():
            r["examples_per_s_compute"] = (r["steps"] * sets["sync.inner.batch_size"] * workers / r["compute_s"]
                                           if r["compute_s"] else None)
        arms[f"workers{workers}"] = res
    return {"arms": arms, "examples_per_s_ratio": examples_ratio(arms)}


def examples_ratio(arms: dict) -> float | None:
    """The two-worker arm's median examples/s per region over the one-worker arm's (2.0 is linear)."""
    med = {}
    for name, res in arms.items():
        rates = sorted(r["examples_per_s_compute"] for r in res.get("regions", {}).values()
                       if r.get("examples_per_s_compute"))
        if not rates:
            return None
        med[name] = rates[len(rates) // 2]
    return med["workers2"] / med["workers1"]


def geofed_run(out: Path, sets: dict, timeout_s: float) -> dict:
    """`geofed run configs/gpt-wan.yaml` with `sets`, the GPU sampled meanwhile; figures from its records."""
    cmd = [sys.executable, "-m", "geofed.orchestrator.cli", "run", str(ROOT / "configs" / "gpt-wan.yaml"),
           "--out", str(out), "--no-report", "--quiet"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    sampler = GpuSampler()
    sampler.start()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        rc, tail = proc.returncode, (proc.stderr or proc.stdout)[-2000:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", f"stopped after {timeout_s:.0f} s"
    sampler.stop.set()
    result = {"command": " ".join(cmd[1:]), "rc": rc, "wall_s": round(time.monotonic() - t0, 1),
              "gpu": sampler.summary(), "overrides": sets}
    if rc != 0:
        result["error"] = tail
    result.update(_run_figures(out))
    return result


def _run_figures(out: Path) -> dict:
    per_region: dict[str, dict] = {}
    metrics = out / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        m = json.loads(line)
        if "region" not in m or "steps" not in m:
            continue
        r = per_region.setdefault(m["region"], {"steps": 0, "compute_s": 0.0, "wall_s": 0.0})
        r["steps"] += m["steps"]
        r["compute_s"] += m.get("compute_s") or 0.0
        r["wall_s"] += m.get("wall_s") or 0.0
    for r in per_region.values():
        r["steps_per_s_compute"] = r["steps"] / r["compute_s"] if r["compute_s"] else None
        r["steps_per_s_wall"] = r["steps"] / r["wall_s"] if r["wall_s"] else None
    figures: dict = {"regions": per_region}
    summary = out / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        figures.update(rounds=s.get("rounds"), eval=s.get("eval"), compute_utilization=s.get("compute_utilization"),
                       utilization_per_region=s.get("utilization_per_region"), bytes_sent=s.get("bytes_sent"),
                       placement={k: {f: v.get(f) for f in ("device", "device_name", "precision")}
                                  for k, v in (s.get("placement") or {}).items()})
    return figures


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, repeat: int, device: str) -> float:
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def bench_codecs(numel: int, repeat: int, device: str = "cuda") -> list[dict]:
    """Each codec's kernels on `device` and the host path a region uses today, in GB/s of fp32 input."""
    from geofed.compression import make_codec

    x = torch.randn(numel, device=device)
    rows = [_bench_codec(make_codec(spec), x, repeat, device) for spec in CODECS]
    if device.startswith("cuda"):
        x = None
        torch.cuda.empty_cache()  # the run's regions get the whole GPU
    return rows


def _bench_codec(codec, x: torch.Tensor, repeat: int, device: str) -> dict:
    from geofed.compression import CodecState, encode_update

    gb = 4 * x.numel() / 1e9
    row: dict = {"codec": codec.name, "numel": x.numel()}
    try:
        shapes = [(x.numel(),)]
        sections = [torch.empty(s.count, dtype=s.dtype, device=device) for s in codec.layout(shapes)]
        state = CodecState(error_feedback=False, seed=0)
        state.bind(shapes)
        state.input_absmax = float(x.abs().max())
        decoded = torch.empty_like(x)
        row["device_encode_gbps"] = gb / _timed(lambda: codec.encode_into(x, shapes, sections, state), repeat, device)
        row["device_decode_gbps"] = gb / _timed(lambda: codec.decode_into(sections, shapes, decoded), repeat, device)
        row["device_rel_error"] = float((decoded - x).norm() / x.norm())
    except Exception as exc:  # noqa: BLE001 - a codec that cannot run on the GPU is a finding, not a crash
        row["device_error"] = f"{type(exc).__name__}: {exc}"[:300]
    row["host_path_encode_gbps"] = gb / _timed(lambda: encode_update(codec, [x]), max(1, repeat // 2), device)
    return row


def main(argv: list[str] | None = None) -> int:
    """Run both checks and print one JSON document; exit 2 without CUDA, 1 when the run failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="run folder (default: a temporary one)")
    ap.add_argument("--max-steps", type=int, default=300, help="inner steps per region (default 300)")
    ap.add_argument("--run-timeout", type=float, default=210.0, help="seconds the run may take (default 210)")
    ap.add_argument("--numel", type=int, default=25_000_000, help="floats per codec update (default 25M)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"which checks, comma-separated, of {', '.join(PARTS)} (default: all)")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    refuse_without_cuda()
    out = args.out or Path(tempfile.mkdtemp(prefix="geofed-gpu-check-"))
    t0 = time.monotonic()
    doc: dict = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
                 "cuda": torch.version.cuda, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    if "codecs" in parts:
        doc["codecs"] = bench_codecs(args.numel, args.repeat)
    if "run" in parts:
        doc["run"] = run_regions(out / "run", args.max_steps, args.run_timeout)
    if "region" in parts:
        doc["region_of_two"] = run_region_of_two(out / "region", args.max_steps, args.run_timeout)
    if "offload" in parts:
        doc["offload"] = check_offload(out / "offload")
    doc["total_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(doc, indent=2))
    return 1 if failed_runs(doc) else 0


def check_offload(out: Path) -> dict:
    """Part 4: device memory with and without sync.outer.offload, and any misplaced buffer."""
    from geofed.bench.memory import offload_cuda_check

    out.mkdir(parents=True, exist_ok=True)
    try:
        return offload_cuda_check("10M", out=out)
    except Exception as exc:  # noqa: BLE001 - a failure here is a finding for the JSON, and the other parts still count
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def failed_runs(doc: dict) -> list[str]:
    """The runs of `doc` that did not end with exit 0 (by part and arm)."""
    runs = {"run": doc.get("run")} | {f"region_of_two.{k}": v for k, v in doc.get("region_of_two", {}).get("arms", {}).items()}
    failed = [name for name, res in runs.items() if res is not None and res.get("rc") != 0]
    offload = doc.get("offload")
    if offload is not None and ("error" in offload or any(r["misplaced"] for r in offload.get("rows", []))):
        failed.append("offload")
    return failed


if __name__ == "__main__":
    sys.exit(main())
