"""`geofed bench cluster`'s arms and its time-to-target reading (no cluster needed)."""

from __future__ import annotations

import json

import pytest

from geofed.compression import CodecSpec
from geofed.bench.cluster_arms import (
    ARMS,
    Target,
    arm_mapping,
    common_mapping,
    reached,
    spread,
    target_supported,
    write_config,
)
from geofed.bench.wan_arms import base_mapping
from geofed.orchestrator.cli import main
from geofed.orchestrator.config import load_config
from geofed.orchestrator.launch.plan import build_plan


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_is_a_valid_multi_region_config_on_issue_14s_task(arm, tmp_path):
    cfg = load_config(write_config(arm_mapping(arm, common_mapping()), tmp_path / f"{arm}.yaml", target=None))
    assert cfg.task.hidden == 256 and cfg.task.layers == 2 and len(cfg.regions.names) == 4
    assert cfg.network.emulation.mode == "none" and cfg.network.bind_host == "0.0.0.0"
    assert cfg.run.eval_every == 1
    build_plan(cfg)   # a multi-node plan can be made of it (ports, bind host, no emulation)


def test_the_arms_differ_only_in_how_they_synchronise(tmp_path):
    common = common_mapping()
    fixed, adaptive, multi = (load_config(write_config(arm_mapping(a, common), tmp_path / f"{a}.yaml", target=None))
                              for a in ("H100-int8", "adaptive-overlap", "multi-region"))
    assert fixed.sync.policy.kind == "fixed" and fixed.sync.policy.H == 100 and fixed.compression.codec.key == "int8"
    wan = base_mapping("bench-wan.yaml")
    assert adaptive.sync.overlap is True and adaptive.sync.policy.target_H == wan["sync"]["policy"]["target_H"]
    assert adaptive.compression.codec == CodecSpec.parse(wan["compression"]["codec"])
    own = base_mapping("multi-region.yaml")  # the multi-region arm is the config as shipped
    assert multi.sync.policy.kind == "bandwidth" and multi.compression.codec == CodecSpec.parse(own["compression"]["codec"])
    assert multi.sync.overlap == own["sync"].get("overlap", False)
    assert fixed.task == adaptive.task == multi.task and fixed.regions == adaptive.regions == multi.regions


def _run_dir(tmp_path, rounds, summary=None):
    d = tmp_path / "run"
    d.mkdir()
    (d / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"region": r, "round": 0}) + "\n" for r in "abcd"))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    return d


def _round(i, acc, *, H=100, t=1.0, sent=400_000):
    return {"round": i, "H": H, "t_start": i * t, "t_end": (i + 1) * t, "bytes_sent": sent,
            "eval_avg": {"metric": "accuracy", "value": acc, "higher_is_better": True}}


def test_time_to_target_is_the_end_of_the_first_round_that_reaches_it(tmp_path):
    d = _run_dir(tmp_path, [_round(0, 0.80), _round(1, 0.949), _round(2, 0.951), _round(3, 0.99)])
    got = reached(d, Target(value=0.95))
    assert (got.time_s, got.steps, got.rounds, got.source) == (3.0, 300, 4, "rounds.jsonl")
    assert got.mb_per_region == pytest.approx(3 * 400_000 / 4 / 1e6)
    assert reached(d, Target(value=0.999)).time_s is None


def test_summary_fields_of_run_target_win_when_the_run_wrote_them(tmp_path):
    summary = {"time_to_target_s": 1.5, "steps_to_target": 200, "bytes_to_target": 2_000_000,
               "placement": {r: {} for r in "abcd"}, "eval": {"value": 0.951}}
    got = reached(_run_dir(tmp_path, [_round(0, 0.5), _round(1, 0.96)], summary), Target())
    assert (got.time_s, got.steps, got.source) == (1.5, 200, "summary")
    assert got.mb_per_region == pytest.approx(0.5)


def test_spread_counts_seeds_that_never_reached():
    assert spread([2.0, None, 1.0]) == {"median": 1.5, "min": 1.0, "max": 2.0, "reached": 2, "seeds": 3}
    assert spread([None])["median"] is None


def test_target_support_is_detected_from_the_config_schema():
    # run.target is issue 14's item 3: used when the run section has it, else read from the evaluations
    import dataclasses

    from geofed.orchestrator.config import RunSection

    has_key = "target" in {f.name for f in dataclasses.fields(RunSection)}
    assert target_supported(common_mapping(), Target()) is has_key


def test_bench_cluster_cli_says_what_it_needs_and_refuses_bad_seeds(monkeypatch, capsys):
    from geofed.p2p.wan import kernel

    monkeypatch.setattr(kernel, "kernel_unavailable", lambda: "needs root (euid is 1000)")
    assert main(["bench", "cluster", "--seeds", "1"]) == 2
    assert "the shaped cluster needs root (euid is 1000)" in capsys.readouterr().err
    monkeypatch.setattr(kernel, "kernel_unavailable", lambda: None)
    assert main(["bench", "cluster", "--seeds", "0"]) == 2
    assert main(["bench", "cluster", "--arms", "nope"]) == 2
