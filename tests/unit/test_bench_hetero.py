"""`geofed bench hetero` without runs: the interleaving order and the document's medians and ratios."""

from __future__ import annotations

import pytest

from geofed.bench.hetero import ARMS, SCENARIOS, TARGETS, arm_config, cells, interleaved
from geofed.bench.hetero_results import document


def test_interleaving_rotates_the_start_and_runs_every_cell_once_per_rep():
    items = cells()
    order = interleaved(items, 3)
    assert len(order) == 3 * len(items)
    for rep in range(3):
        got = [c for r, c in order if r == rep]
        assert sorted(got, key=lambda c: c.name) == sorted(items, key=lambda c: c.name)
        assert got[0] == items[rep % len(items)]  # repetition i starts at cell i
    assert [r for r, _ in order] == sorted(r for r, _ in order)  # a repetition ends before the next starts


def test_arm_configs_lay_scenario_and_arm_over_the_base():
    slow_quorum = arm_config(next(c for c in cells() if c.scenario == "slow" and c.arm == "quorum"), quick=True)
    assert slow_quorum.sync.pacing.mode == "quorum" and not slow_quorum.sync.overlap
    slowdown = slow_quorum.regions.emulation.slowdown
    assert slowdown["eu-west-1"] == 4 * slowdown["us-east-1"]  # 4x the common factor
    flaky = arm_config(next(c for c in cells() if c.scenario == "flaky"), quick=False)
    assert flaky.regions.emulation.availability.absent_p == 0.25
    assert {c.scenario for c in cells()} == set(SCENARIOS) and {c.arm for c in cells()} == set(ARMS)


def _row(rep, scenario, arm, t, metric=0.97, idle=0.05):
    return {"rep": rep, "scenario": scenario, "arm": arm, "time_to_target_s": t, "steps_to_target": 100.0,
            "final_metric": metric, "bytes_sent": 1e6, "fast_idle_fraction": idle, "wall_s": 10.0}


def test_ratios_are_per_repetition_medians_against_the_same_arm_in_equal():
    rows = []
    for rep, load in enumerate((1.0, 2.0, 1.5)):  # load that comes and goes scales a whole repetition
        rows += [_row(rep, "equal", "barrier", 2 * load), _row(rep, "equal", "quorum", 2 * load, metric=0.975),
                 _row(rep, "slow", "barrier", 8 * load), _row(rep, "slow", "quorum", 2.4 * load, metric=0.97),
                 _row(rep, "flaky", "barrier", 3 * load), _row(rep, "flaky", "quorum", 2.2 * load)]
    doc = document(rows, reps=3, quick=False, targets=TARGETS)
    assert doc["best_arm"] == {"slow": "quorum", "flaky": "quorum", "slow_least_idle": "quorum"}
    assert doc["ratios"]["slow_least_idle_fraction"] == pytest.approx(0.05)
    assert doc["ratios"]["slow_barrier_vs_equal"] == pytest.approx(4.0)  # exact per rep, whatever the load
    assert doc["ratios"]["slow_best_vs_equal"] == pytest.approx(1.2)
    assert doc["spread"]["slow_best_vs_equal"] == {"min": pytest.approx(1.2), "max": pytest.approx(1.2)}
    assert doc["ratios"]["flaky_best_vs_equal"] == pytest.approx(1.1)
    assert doc["ratios"]["slow_best_metric_delta"] == pytest.approx(-0.005)
    assert doc["ratios"]["slow_fast_idle_fraction"] == pytest.approx(0.05)
    assert doc["targets_met"]["slow_best_vs_equal"] is True
    quorum_slow = next(a for a in doc["arms"] if (a["scenario"], a["arm"]) == ("slow", "quorum"))
    assert quorum_slow["time_to_target_s"] == pytest.approx(3.6) and quorum_slow["spread"]["time_to_target_s"]["max"] == pytest.approx(4.8)


def test_an_arm_that_never_reaches_the_target_is_not_the_best():
    rows = [_row(0, "equal", "barrier", 2.0), _row(0, "equal", "drop", 2.0), _row(0, "slow", "drop", None),
            _row(0, "slow", "barrier", 8.0)]
    doc = document(rows, reps=1, quick=True, targets=TARGETS)
    assert doc["best_arm"]["slow"] is None and doc["ratios"]["slow_best_vs_equal"] is None
    assert doc["ratios"]["slow_barrier_vs_equal"] == pytest.approx(4.0)


def test_a_loss_base_reaches_its_target_from_above_and_its_delta_is_relative():
    from geofed.bench.hetero import BASES

    lm = BASES["char-lm"]
    assert not lm.higher_is_better and lm.targets()["slow_best_metric_delta"] == -0.02
    cfg = arm_config(next(c for c in cells() if c.scenario == "slow"), quick=True, task="char-lm")
    assert cfg.task.kind == "char-lm"
    rows = [_row(0, "equal", "quorum", 2.0, metric=2.0), _row(0, "slow", "quorum", 2.2, metric=2.03),
            _row(0, "equal", "barrier", 2.0, metric=2.0), _row(0, "slow", "barrier", 8.0, metric=2.0)]
    doc = document(rows, reps=1, quick=True, targets=lm.targets(), higher_is_better=False)
    assert doc["ratios"]["slow_best_metric_delta"] == pytest.approx(-0.015)  # 1.5% higher loss: worse
    assert doc["targets_met"]["slow_best_metric_delta"] is True


def test_measure_reads_a_loss_target_from_above(tmp_path):
    import json

    from geofed.bench.hetero_results import measure

    (tmp_path / "summary.json").write_text(json.dumps({"wall_s": 4.0, "eval": {"value": 1.9}, "bytes_sent": 10}))
    rounds = [{"round": r, "t_end": 1.0 + r, "eval_avg": {"value": v}} for r, v in enumerate((3.0, 2.1, 2.0, 1.9))]
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"round": r, "region": "a", "steps": 10, "compute_s": 0.9}) + "\n" for r in range(4)))
    m = measure(tmp_path, target=2.05, higher_is_better=False)
    assert m["time_to_target_s"] == 3.0 and m["steps_to_target"] == 30
    assert measure(tmp_path, target=2.05)["time_to_target_s"] == 1.0  # as accuracy: 3.0 >= 2.05 at round 0
