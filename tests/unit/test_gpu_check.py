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


def test_the_region_of_two_overrides_are_valid_keys(tinyshakespeare_txt):
    # Part 3's arms with the device swapped for the CPU: two regions of two workers is a config validate takes.
    for workers in (1, 2):
        sets = {**gpu_check.region_sets(workers, 300), "regions.device": "cpu", "regions.num_gpus": 0}
        args = ["validate", str(ROOT / "configs" / "gpt-wan.yaml")]
        for k, v in sets.items():
            args += ["--set", f"{k}={v}"]
        assert main(args) == 0, workers


def test_the_examples_ratio_is_the_median_region_of_two_workers_over_one():
    def arm(*rates):
        return {"regions": {f"r{i}": {"examples_per_s_compute": x} for i, x in enumerate(rates)}}
    assert gpu_check.examples_ratio({"workers1": arm(100.0, 110.0), "workers2": arm(190.0, 200.0)}) == 200.0 / 110.0
    assert gpu_check.examples_ratio({"workers1": arm(100.0), "workers2": {"regions": {}}}) is None  # a failed arm


def test_an_unknown_part_is_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--parts", "codecs,regoin"])
    assert e.value.code == 2 and "--parts: unknown regoin" in capsys.readouterr().err


def test_failed_runs_names_each_part_and_arm_that_did_not_exit_0():
    doc = {"run": {"rc": 0}, "region_of_two": {"arms": {"workers1": {"rc": 0}, "workers2": {"rc": "timeout"}}}}
    assert gpu_check.failed_runs(doc) == ["region_of_two.workers2"]
    assert gpu_check.failed_runs({"codecs": []}) == []


def test_the_offload_part_reports_no_cuda_as_its_error_and_counts_as_failed(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the offload part would measure, not fail")
    res = gpu_check.check_offload(tmp_path)
    assert "needs CUDA" in res["error"]
    assert gpu_check.failed_runs({"offload": res}) == ["offload"]
    assert gpu_check.failed_runs({"offload": {"rows": [{"misplaced": []}, {"misplaced": ["a: global on cpu"]}]}}) \
        == ["offload"]
