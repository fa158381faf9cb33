"""Evaluation changes nothing and costs nothing on the wire; run.target ends a run at its target."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.orchestrator.driver.run import Runner

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1"]


def _cfg(**run):
    return config_from_mapping({
        "run": {"name": "t", "rounds": 5, "report": False, "checkpoint_every": 0, "seed": 3, **run},
        "task": {"kind": "mlp-digits", "hidden": 32},
        "regions": {"names": REGIONS, "num_cpus": 0.5},
        "network": {"emulation": {"mode": "none"}},
        # Overlap: the exchange of round r is still in flight when round r is evaluated.
        "sync": {"overlap": True, "policy": {"kind": "fixed", "H": 10}, "inner": {"lr": 0.01},
                 "outer": {"momentum": 0.5}, "deadline": {"initial_s": 30, "min_s": 30}},
        "compression": {"codec": "int8"},
    })


def _train(cfg, run_dir):
    runner = Runner(cfg, run_dir, show_progress=False)
    try:
        summary = runner.run()
        params = runner.regions.get_params(runner.regions.alive, timeout=60)
    finally:
        runner.shutdown()
    return summary, params


def test_evaluating_every_round_trains_the_same_model_and_sends_nothing_more(tmp_path):
    # Side by side (their own actors and run directories; 30 s deadlines keep every update on time).
    with ThreadPoolExecutor(max_workers=1) as pool:
        quiet_run = pool.submit(_train, _cfg(eval_every=0), tmp_path / "quiet")
        watched, watched_params = _train(_cfg(eval_every=1), tmp_path / "watched")
        quiet, quiet_params = quiet_run.result()
    for region in REGIONS:
        for a, b in zip(quiet_params[region], watched_params[region]):
            assert torch.equal(a, b), f"{region}: evaluation changed the trained model"
    assert watched["bytes_sent"] == quiet["bytes_sent"] and watched["eval_fetch_bytes"] == 0
    rounds = read_jsonl(tmp_path / "watched" / "rounds.jsonl")
    # With overlap, round r's synchronised model is evaluated when its exchange completes, during
    # round r + 1 (the last round's in its final flush): every round is evaluated exactly once.
    assert [r.get("eval_round") for r in rounds] == [None, 0, 1, 2, 4]
    evaluated = [r for r in rounds if "eval_avg" in r]
    assert all(r["eval_avg"]["metric"] == "accuracy" and r["eval_region"] == REGIONS[0] for r in evaluated)
    assert all(prev["t_end"] <= r["eval_t"] <= r["t_end"] for prev, r in zip(rounds, rounds[1:]) if "eval_t" in r)
    # Only the evaluating region spends the compute; no round waited for its overlapped exchange.
    metrics = read_jsonl(tmp_path / "watched" / "metrics.jsonl")
    assert {m["region"] for m in metrics if "eval" in m} == {REGIONS[0]}
    assert all(m["exchange_round"] == m["round"] - 1 for m in metrics if 0 < m["round"] < 4)
    assert evaluated[-1]["eval_avg"]["value"] > evaluated[0]["eval_avg"]["value"]
    assert quiet["eval"]["value"] == pytest.approx(watched["eval"]["value"], abs=1e-12)


def test_a_run_ends_at_its_target_and_says_what_reaching_it_cost(tmp_path):
    cfg = _cfg(rounds=40, target={"metric": "accuracy", "value": 0.9})
    summary, _ = _train(cfg, tmp_path)
    rounds = read_jsonl(tmp_path / "rounds.jsonl")
    hit = summary["target"]
    # Overlap: the model of round r is evaluated during round r + 1; the run stops after that round.
    last = rounds[-1]
    assert hit["reached"] and hit["round"] == last["eval_round"] == last["round"] - 1 < 38
    earlier = [r["eval_avg"]["value"] for r in rounds[:-1] if "eval_avg" in r]
    assert earlier and last["eval_avg"]["value"] >= 0.9 > max(earlier)
    assert summary["time_to_target_s"] == last["eval_t"] and rounds[-2]["t_end"] <= last["eval_t"] <= last["t_end"]
    # What reaching it cost counts the rounds up to the evaluated one, not the round after it.
    assert summary["steps_to_target"] == 10 * (hit["round"] + 1)
    # ...and the exchanges of those rounds: with overlap round r's is reported with round r + 1.
    assert summary["bytes_to_target"] == sum(r["bytes_sent"] for r in rounds)
    (event,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "target_reached"]
    assert event["round"] == hit["round"]
    assert json.loads((tmp_path / "summary.json").read_text())["target"] == hit


def test_a_target_on_a_metric_the_task_does_not_report_is_named(tmp_path):
    from geofed.orchestrator.driver.recovery import RunFailed

    with pytest.raises(RunFailed, match=r"run.target.metric is 'loss', but task mlp-digits evaluates 'accuracy'"):
        _train(_cfg(rounds=3, target={"metric": "loss", "value": 0.1}), tmp_path)
