"""`geofed bench memory` without Ray: its arguments, its arms' configs, and how it reads a region
process's peak memory from outside (VmHWM of the pids in the run's events.jsonl)."""

from __future__ import annotations

import json
import os
import time

import pytest

from geofed.bench.cli import main as bench_main
from geofed.bench.memory import ARMS, SIZES, PeakWatch, arm_config, count_params, main, vm_hwm


@pytest.mark.parametrize("argv, what", [(["--sizes", "2M"], "--sizes: unknown 2M"),
                                        (["--arms", "serial,lazy"], "--arms: unknown lazy"),
                                        (["--sizes", ","], "--sizes: unknown (none given)"),
                                        (["--rounds", "0"], "--rounds and --H must be >= 1")])
def test_bad_sizes_and_arms_are_refused_by_name(argv, what, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert what in err


def test_the_bench_command_lists_memory(capsys):
    assert bench_main(["-h"]) == 0
    assert "memory" in capsys.readouterr().out


def test_every_arm_is_a_valid_run_config_and_the_sizes_are_what_they_say(tinyshakespeare_txt):
    for arm in ARMS:
        cfg = arm_config(arm, "1M", rounds=2, H=1)
        assert cfg.compression.codec.kind == "int8" and cfg.run.rounds == 2
    assert arm_config("secagg", "1M", rounds=2, H=1).security.secure_aggregation
    assert arm_config("checkpoint", "1M", rounds=2, H=1).run.checkpoint_every == 1
    assert not arm_config("no-rollback", "1M", rounds=2, H=1).security.rollback_on_nonfinite
    assert arm_config("offload", "1M", rounds=2, H=1).sync.outer.offload
    assert not arm_config("delayed", "1M", rounds=2, H=1).sync.outer.offload
    cuda = arm_config("delayed", "1M", rounds=2, H=1, extra={"regions": {"device": "cuda:0", "num_gpus": 0.5}})
    assert cuda.regions.device == "cuda:0" and cuda.regions.names == arm_config("delayed", "1M", rounds=2, H=1).regions.names
    for size, want in [("1M", 1e6), ("10M", 1e7), ("30M", 3e7), ("100M", 1e8)]:
        n = count_params(arm_config("serial", size, rounds=1, H=1))  # on the meta device: no memory
        assert 0.9 * want <= n <= 1.1 * want, (size, n)
    assert set(SIZES) == {"1M", "10M", "30M", "100M"}


def test_peak_watch_reads_the_high_water_mark_of_the_pids_the_run_names(tmp_path):
    assert vm_hwm(os.getpid()) > 10 << 20
    assert vm_hwm(2 ** 22 + 12345) is None  # no such process
    run = tmp_path / "run"
    run.mkdir()
    with PeakWatch(run, rounds=2) as watch:
        time.sleep(0.3)
        assert watch.peak == {} and watch.at_last_round is None  # no "started" event yet
        (run / "events.jsonl").write_text(json.dumps({"event": "started", "regions": {"a": {"pid": os.getpid()}}}) + "\n")
        (run / "rounds.jsonl").write_text("{}\n")
        time.sleep(0.3)
        assert watch.peak["a"] > 0 and watch.at_last_round is None  # one round of two logged
        (run / "rounds.jsonl").write_text("{}\n{}\n")
        deadline = time.monotonic() + 5
        while watch.at_last_round is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert watch.at_last_round is not None and watch.at_last_round["a"] <= watch.peak["a"]


def test_a_failed_arm_is_named_and_the_other_arms_still_give_rows(tmp_path, monkeypatch, capsys, tinyshakespeare_txt):
    from contextlib import nullcontext

    import geofed.bench.memory as memory
    import geofed.bench.runs as runs
    from geofed.orchestrator.driver.recovery import RunFailed

    def fake_measure(arm, size, out, **kw):
        if arm == "secagg":
            raise RunFailed("region eu-west-1 failed in round 1: payload exceeds max_message_bytes")
        return {"arm": arm, "size": size, "params": kw["params"], "peak_rss_bytes": 3 << 20,
                "baseline_rss_bytes": kw["baseline"], "bytes_per_param": 1.0}

    monkeypatch.setattr(runs, "bench_ray", lambda cfg: nullcontext())
    monkeypatch.setattr(memory, "idle_actor_baseline", lambda: 1 << 20)
    monkeypatch.setattr(memory, "measure", fake_measure)
    rc = main(["--sizes", "1M", "--arms", "serial,secagg,export", "--json", "--out", str(tmp_path / "b")])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert rc == 1 and [r["arm"] for r in doc["rows"]] == ["serial", "export"]
    assert doc["failed"] == [{"arm": "secagg", "size": "1M", "error": "region eu-west-1 failed in round 1: payload exceeds max_message_bytes"}]
    assert "1M secagg FAILED" in captured.err and "1 run(s) failed" in captured.err


def test_drop_bulk_frees_checkpoints_and_the_export_and_keeps_the_logs(tmp_path):
    from geofed.bench.memory import drop_bulk

    run = tmp_path / "run"
    (run / "checkpoints" / "eu").mkdir(parents=True)
    (run / "checkpoints" / "eu" / "round-2.pt").write_bytes(b"x" * 1000)
    (run / "model.safetensors").write_bytes(b"y" * 500)
    (run / "rounds.jsonl").write_text("{}\n")
    assert drop_bulk(run) == 1500
    assert sorted(p.name for p in run.iterdir()) == ["rounds.jsonl"]
    assert drop_bulk(run) == 0  # nothing left to free
