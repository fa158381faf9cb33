"""`geofed bench attack --quick --arms flip_bound --json`, for real on the session's Ray: 4 region
actors over mutual-TLS gRPC, one of them (eu-west-1) a hostile member whose own code sends its
update sign-flipped at the clip bound, against the undisturbed run.

What is checked is the bench's plumbing and the JSON document, and that the member's acts reach
the honest regions' counts: on today's code (clip at 10x the median norm) the flipped updates are
clipped and counted under `clipped`, though they still cost accuracy (issue 36's N4). Round 0 may
escape: no region judges a norm before it knows 3 (geofed.p2p.robust.UpdateAdmission.min_samples).

New code: this failed with ModuleNotFoundError (geofed.bench.attack) before it.
"""

from __future__ import annotations

import json

import pytest

from geofed.bench.attack import QUICK, main

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow, pytest.mark.timeout(600)]


def test_quick_flip_bound_counts_the_members_acts(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["--quick", "--arms", "flip_bound", "--json", "--out", str(out)])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert rc in (0, 1)  # 1: a target missed (today's code misses the accuracy one), never a crash
    assert "--quick: 1 repetition" in captured.err and "rep 1 flip_bound" in captured.err
    assert doc["reps"] == 1 and doc["quick"] is True
    (arm,) = doc["arms"]
    assert {"name", "metric_delta_points", "time_ratio", "died", "refusals"} <= set(arm)
    assert arm["name"] == "flip_bound" and arm["died"] is False
    assert isinstance(arm["metric_delta_points"], float) and arm["time_ratio"] > 0
    assert set(doc["spread"]["flip_bound"]) == {"metric_delta_points", "time_ratio"}
    assert set(arm["targets"]) == {"metric", "time", "alive", "counted", "all"}
    # The member pushed a flipped update to each of 3 peers in each round.
    assert arm["acts"] == {"flipped": 3 * QUICK["rounds"]}
    # Each flip refused as harmful by the gauntlet (regions/gauntlet.py) or clipped at the mix.
    caught = arm["refusals"].get("clipped", 0) + arm["refusals"].get("harmful", 0)
    assert caught >= 3 * (QUICK["rounds"] - 1), arm["refusals"]
    assert arm["counted"] >= arm["acts_total"] - 3
    # Each run kept its directory, and bench.json holds every run's own numbers.
    kept = json.loads((out / "bench.json").read_text())
    assert [r["name"] for r in kept["runs"]] == ["undisturbed", "flip_bound"]
    for r in kept["runs"]:
        assert (out / f"{r['name']}-rep1").is_dir() and not r["died"]
