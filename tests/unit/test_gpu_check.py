"""benchmarks/gpu_check.py: without CUDA it refuses at once (exit 2, one clear line); its codec
timing and its run's overrides work where a CPU can check them. It never runs on a GPU here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check

from geofed.orchestrator.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run")
def test_without_cuda_it_exits_2_at_once_with_one_clear_line():
    t = time.monotonic()
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert "no CUDA device" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert time.monotonic() - t < 30  # nothing started: no Ray, no run


def test_the_codec_timing_runs_on_cpu_tensors():
    rows = gpu_check.bench_codecs(20_000, 1, device="cpu")
    assert [r["codec"] for r in rows][:4] == ["fp16", "bf16", "int8", "int4"]
    for r in rows:
        assert "device_error" not in r, r
        assert r["device_encode_gbps"] > 0 and r["host_path_encode_gbps"] > 0
    assert rows[0]["device_rel_error"] < 1e-3  # fp16 round trip


def test_the_runs_overrides_are_valid_keys(tinyshakespeare_txt):
    # The GPU run's --set list, with the device swapped for the CPU (validate refuses cuda here).
    sets = {"regions.device": "cpu", "regions.num_gpus": 0, "regions.num_cpus": 1, "sync.inner.precision": "bf16",
            "sync.inner.batch_size": 32, "run.max_steps": 300, "network.emulation.bandwidth_scale": 1.0,
            **gpu_check.MODEL}
    args = ["validate", str(ROOT / "configs" / "gpt-wan.yaml")]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    assert main(args) == 0
