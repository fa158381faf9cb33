"""`geofed bench plan`'s design (no runs): its cells, their configs, and the document's arithmetic."""

from __future__ import annotations

import json

import pytest

from geofed.bench.plan import CODECS, EXTRA, HS, cell_config, cells, matrices
from geofed.bench.plan_results import document, predict_cell


def test_sixteen_cells_every_H_meets_every_codec_and_every_config_loads():
    cs = cells(8)
    assert len(cs) == len(set(cs)) == 12 + len(EXTRA) == 16 and len(matrices(8)) == 4
    assert {(H, c) for _, H, c in cs[:12]} == {(H, c) for H in HS for c in CODECS}
    assert {m for m, _, _ in cs} == set(matrices(8))
    for c in cs:
        cfg = cell_config(*c, rounds=8)
        assert cfg.sync.policy.H == c[1] and cfg.network.emulation.mode == "proxy"


def test_the_slow_link_is_predicted_the_bottleneck_and_the_drop_slows_the_later_rounds():
    slow = predict_cell(cell_config("slow-link", 100, "fp16", rounds=8), 0.003)
    assert slow["pred_bottleneck"] in ("us-east-1->ap-northeast-1", "ap-northeast-1->us-east-1")
    base = predict_cell(cell_config("aws-scaled", 100, "fp16", rounds=8), 0.003)
    drop = predict_cell(cell_config("drop", 100, "fp16", rounds=8), 0.003)
    assert drop["pred_round_s"] > base["pred_round_s"] * 1.5
    assert drop["pred_bytes_per_round"] == base["pred_bytes_per_round"]


def _row(matrix, H, round_s, pred_round_s, util, pred_util, b=1000, pb=1000):
    return {"matrix": matrix, "H": H, "codec": "int8", "round_s": round_s, "pred_round_s": pred_round_s,
            "utilization": util, "pred_utilization": pred_util, "bytes_per_round": b, "pred_bytes_per_round": pb,
            "step_s": 0.01}


def test_document_errors_and_the_recommendation_ratio():
    rows = [_row("m", 20, 1.0, 1.1, 0.2, 0.2), _row("m", 100, 2.0, 1.8, 0.6, 0.7, 1000, 1005),
            _row("m", 400, 10.0, 6.0, 0.55, 0.9)]
    doc = document(rows, probe_step_s=0.005, floor=0.5, targets={}, rounds=8)
    assert doc["round_time_median_abs_err"] == pytest.approx(0.1)
    assert doc["round_time_worst_abs_err"] == pytest.approx(0.4)
    assert doc["bytes_worst_abs_err"] == pytest.approx(0.005)
    # predicted: H=400 fastest per step (15 ms); measured best above the floor: H=100 (20 ms) -> 25/20
    assert doc["recommendation"]["m"]["recommended"] == "H=400 int8"
    assert doc["recommended_vs_best"] == pytest.approx(1.25)
    assert doc["probe_step_ratio"] == pytest.approx(0.5)
    assert doc["recommendation"]["m"]["recommended_met_floor"]


def test_a_matrix_where_no_run_met_the_floor_is_compared_with_its_fastest_run():
    rows = [_row("m", 20, 1.0, 1.0, 0.3, 0.6), _row("m", 400, 4.0, 4.0, 0.4, 0.4),
            _row("n", 100, 1.0, 1.0, 0.9, 0.9)]
    doc = document(rows, probe_step_s=0.01, floor=0.5, targets={}, rounds=8)
    m = doc["recommendation"]["m"]
    # The pick was predicted above the floor (0.6) and missed it; the best is the fastest per step (10 ms).
    assert (m["recommended"], m["recommended_predicted_to_meet_floor"], m["recommended_met_floor"]) == ("H=20 int8", True, False)
    assert (m["best"], m["best_met_floor"], m["ratio"]) == ("H=400 int8", False, pytest.approx(5.0))
    assert doc["recommended_vs_best"] == pytest.approx(5.0)
    assert doc["recommended_vs_best_where_a_run_met_floor"] == pytest.approx(1.0)   # matrix n only


def test_the_bench_picks_by_the_plans_rule_cheapest_per_step_above_the_floor():
    # Both predicted above the floor: the rule takes the cheaper per step (H=400), not the faster.
    rows = [{**_row("m", 100, 1.0, 1.0, 0.9, 0.9), "pred_egress_usd_per_step": 2e-6},
            {**_row("m", 400, 4.4, 4.4, 0.85, 0.85), "pred_egress_usd_per_step": 1e-6}]
    doc = document(rows, probe_step_s=0.01, floor=0.5, targets={}, rounds=8)
    m = doc["recommendation"]["m"]
    assert (m["recommended"], m["best"], m["rule_on_measured"]) == ("H=400 int8", "H=100 int8", "H=400 int8")
    assert m["ratio"] == pytest.approx(1.1)


def _policy_run(tmp_path):
    """A run directory as a 2-region adaptive run writes it: round 0 at initial_H, then the policy's H."""
    rounds, metrics = [], []
    for r, H in enumerate((200, 50, 70, 90)):
        rounds.append({"round": r, "H": H, "codecs": {"a->b": "fp16", "b->a": "fp16"}, "t_start": 10.0 * r,
                       "t_end": 10.0 * r + 1.0})
        metrics += [{"round": r, "region": g, "steps": H, "compute_s": 0.9 if g == "a" else 0.5,
                     "step_time_s": 0.9 / H, "bytes_sent": 1000} for g in ("a", "b")]
    for name, recs in (("rounds.jsonl", rounds), ("metrics.jsonl", metrics)):
        (tmp_path / name).write_text("".join(json.dumps(x) + "\n" for x in recs))
    return tmp_path


def test_a_shipped_configs_row_sets_the_plans_H_and_utilisation_beside_the_runs(tmp_path):
    """Issue 37 item 2: `geofed bench plan` gains the shipped configs (the default one at least),
    predicted against measured utilisation and H. Before, the bench had no such rows:
    ModuleNotFoundError (no bench.plan_shipped) and `--matrix shipped` was exit 2."""
    from geofed.bench.plan import _parser
    from geofed.bench.plan_shipped import SHIPPED, measure_policy_run, shipped_config, shipped_row

    assert "local-wan.yaml" in SHIPPED
    cfg = shipped_config("local-wan.yaml")
    assert cfg.sync.policy.kind == "bandwidth" and cfg.run.report is False and cfg.run.rounds == 30
    assert _parser().parse_args(["--matrix", "shipped"]).matrices == ["shipped"]
    m = measure_policy_run(_policy_run(tmp_path))
    # Rounds 1..3 (round 0 runs initial_H before anything is measured): the slowest region's compute / wall.
    assert (m["H_lo"], m["H_hi"], m["H_median"], m["codecs"]) == (50, 90, 70, "fp16".split())
    assert m["utilization"] == pytest.approx(0.9)
    pred = {"pred_H": 80, "pred_codec": "fp16", "pred_utilization": 0.81, "H_min": 50, "H_max": 2000}
    row = shipped_row("local-wan.yaml", pred, m)
    assert row["config"] == "configs/local-wan.yaml" and row["utilization_rel_err"] == pytest.approx(-0.1)
    assert row["utilization_ok"] and row["pred_H_in_policy_range"] and row["pred_H_in_run_span"]
    assert row["pred_codec_used"] and row["pred_H_over_run_median"] == pytest.approx(80 / 70)
    far = shipped_row("local-wan.yaml", {**pred, "pred_H": 2500, "pred_utilization": 0.24}, m)
    assert not (far["utilization_ok"] or far["pred_H_in_policy_range"] or far["pred_H_in_run_span"])
