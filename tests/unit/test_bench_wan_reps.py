"""`geofed bench wan` repetitions: the documented interleaved order, medians and spreads of
per-repetition ratios, on synthetic ArmResult rows (no Ray, no run directories)."""

from __future__ import annotations

import pytest
from geofed.bench import wan as bench_wan
from geofed.bench.wan_reps import (
    combine,
    interleaved_schedule,
    median_reached,
    median_spread,
    representative,
)
from geofed.bench.wan_results import ArmResult

RATIO_KEYS = {"time_vs_allreduce", "bytes_vs_allreduce", "loss_vs_allreduce", "time_vs_best_fixed",
              "time_vs_best_fixed_before_drop"}


def test_the_order_is_round_robin_with_the_start_arm_rotated_per_repetition():
    # as the module docstring and docs/bench-wan.md say: A B C, then B C A, then C A B
    assert interleaved_schedule(["A", "B", "C"], 3) == [
        (0, "A"), (0, "B"), (0, "C"), (1, "B"), (1, "C"), (1, "A"), (2, "C"), (2, "A"), (2, "B")]
    assert interleaved_schedule(["A", "B", "C"], 1) == [(0, "A"), (0, "B"), (0, "C")]  # --quick: today's order
    sched = interleaved_schedule(list("ABCDE"), 4)
    for r in range(4):
        assert sorted(a for rr, a in sched if rr == r) == list("ABCDE")  # every arm once per repetition
    assert [a for _, a in sched[::5]] == list("ABCD")  # a different arm starts each repetition
    assert [rr for rr, _ in sched] == sorted(rr for rr, _ in sched)  # repetitions never overlap
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="reps: must be an integer >= 1"):
            interleaved_schedule(["A"], bad)


def _arm(name, t, b=None, *, kind=None, H=None, loss=1.0, util=0.9):
    kind = kind or ("allreduce" if name == "allreduce" else "fixed" if name.startswith("fixed") else "adaptive")
    return ArmResult(name=name, kind=kind, H=H, H_rounds=[], time_to_target_s=t, bytes_to_target=b,
                     final_loss=loss, eval=None, eval_metric=None, utilization=util, utilization_wall=None,
                     utilization_training=None, steps=100, loss_at_baseline_steps=None, wall_s=None,
                     bytes_sent=0.0, drop_at_s=None, run_dir=f"/nonexistent/{name}")


def _reps():
    # rep 2 had a load spike on the per-step arm only: its ratio is the outlier the median drops
    return [
        [_arm("allreduce", 10.0, 6e8), _arm("fixed-H100", 1.2, 2e6, H=100), _arm("adaptive", 1.0, 1e6, H=150)],
        [_arm("fixed-H100", 2.0, 2e6, H=100), _arm("adaptive", 2.5, 1e6, H=170), _arm("allreduce", 40.0, 6e8)],
        [_arm("adaptive", 1.5, 1.2e6, H=160, util=0.95), _arm("allreduce", 12.0, 6e8), _arm("fixed-H100", None, None, H=100)],
    ]


def test_ratios_are_medians_of_per_repetition_ratios_with_their_spread():
    out = combine(_reps(), "steady")
    # time_vs_allreduce per rep: 10/1 = 10, 40/2.5 = 16, 12/1.5 = 8 -> median 10 (not 62/5 = 12.4 of the medians)
    assert out["ratios"]["time_vs_allreduce"] == 10.0
    assert out["spread"]["time_vs_allreduce"] == {"min": 8.0, "max": 16.0, "n": 3}
    # bytes: 600, 600, 500
    assert out["ratios"]["bytes_vs_allreduce"] == 600.0
    assert out["spread"]["bytes_vs_allreduce"] == {"min": 500.0, "max": 600.0, "n": 3}
    # best fixed: 1.2/1.0 = 1.2, 2.0/2.5 = 0.8, and rep 3's fixed arm never reached the target: no ratio
    assert out["ratios"]["time_vs_best_fixed"] == pytest.approx(1.0)
    assert out["spread"]["time_vs_best_fixed"] == {"min": 0.8, "max": 1.2, "n": 2}
    assert out["ratios"]["time_vs_best_fixed_before_drop"] is None
    assert out["spread"]["time_vs_best_fixed_before_drop"] == {"min": None, "max": None, "n": 0}
    assert set(out["ratios"]) == set(out["spread"]) == RATIO_KEYS
    assert out["reps"] == 3 and [r["rep"] for r in out["per_rep"]] == [1, 2, 3]
    assert out["per_rep"][1]["ratios"]["time_vs_allreduce"] == 16.0
    assert [n.get("best_fixed") for n in out["notes"]] == ["fixed-H100", "fixed-H100", None]


def test_arm_rows_keep_their_keys_and_are_medians_where_never_reached_ranks_last():
    out = combine(_reps(), "steady")
    arms = {a["name"]: a for a in out["arms"]}
    assert [a["name"] for a in out["arms"]] == ["allreduce", "fixed-H100", "adaptive"]  # repetition 0's order
    assert all(set(a) == {"name", "H", "time_to_target_s", "bytes_to_target", "final_loss", "eval", "utilization",
                           "peak_to_mean", "eval_at_baseline_steps"}
               for a in out["arms"])
    assert arms["adaptive"]["time_to_target_s"] == 1.5 and arms["adaptive"]["H"] == 160
    assert arms["adaptive"]["bytes_to_target"] == 1_000_000 and arms["adaptive"]["utilization"] == 0.9
    assert arms["fixed-H100"]["time_to_target_s"] == 2.0  # 1.2, 2.0, never: the middle is 2.0
    assert arms["fixed-H100"]["eval"] is None


def test_median_helpers():
    assert median_spread([3.0, None, 1.0, 2.0]) == (2.0, {"min": 1.0, "max": 3.0, "n": 3})
    assert median_spread([6.0, 10.0]) == (8.0, {"min": 6.0, "max": 10.0, "n": 2})  # even: mean of the middle two
    assert median_spread([None]) == (None, {"min": None, "max": None, "n": 0})
    assert median_reached([1.0, None, 3.0]) == 3.0
    assert median_reached([None, None, 1.0]) is None
    assert median_reached([None, 2.0]) is None and median_reached([]) is None
    runs = [_arm("adaptive", 3.0), _arm("adaptive", None), _arm("adaptive", 1.0)]
    assert representative(runs) is runs[0]  # 1.0, 3.0, never: the middle run
    assert representative(runs[:1]) is runs[0]


def test_repetitions_must_hold_the_same_arms():
    reps = _reps()
    reps[2] = reps[2][:2]
    with pytest.raises(ValueError, match=r"per_rep\[2\]: arms"):
        combine(reps, "steady")
    with pytest.raises(ValueError, match="per_rep: no repetitions"):
        combine([], "steady")


def test_reps_flag_is_checked_before_anything_runs(capsys):
    assert bench_wan.main(["--reps", "0"]) == 2
    assert "--reps: must be an integer >= 1, got '0'" in capsys.readouterr().err
    assert bench_wan.main(["--reps", "x"]) == 2


def test_target_lines_say_the_median_and_spread_or_that_quick_has_none():
    from geofed.bench.wan_arms import SCENARIOS

    out = combine(_reps(), "steady")
    doc = {"scenario": "steady", "arms": out["arms"], "ratios": out["ratios"], "reps": 3, "spread": out["spread"]}
    lines = bench_wan.check_targets(SCENARIOS["steady"], [], doc)
    assert lines[0].startswith("time_vs_allreduce: 10 (median of 3/3 repetitions, min 8, max 16) (target >= 20) [red]NOT met")
    doc1 = {**doc, "reps": 1}
    assert "(1 repetition: no spread)" in bench_wan.check_targets(SCENARIOS["steady"], [], doc1)[0]


def test_the_table_shows_medians_and_names_the_repetitions():
    from geofed.bench.wan_arms import SCENARIOS
    from rich.console import Console

    reps = _reps()
    out = combine(reps, "steady")
    doc = {"scenario": "steady", "arms": out["arms"], "ratios": out["ratios"], "reps": 3, "spread": out["spread"]}
    results = [representative([next(a for a in rep if a.name == n) for rep in reps])
               for n in ("allreduce", "fixed-H100", "adaptive")]
    console = Console(record=True, width=200)
    bench_wan.print_results(console, SCENARIOS["steady"], results, doc)
    text = console.export_text()
    assert "medians of 3 repetitions" in text and "1.50 s" in text and "12.00 s" in text  # medians, not a rep's
    assert "median of 3/3 repetitions, min 8, max 16" in text


def test_frontier_arms_get_their_own_ratios_and_the_best_arm_its_peak_to_mean():
    from geofed.bench.wan import best_arm_peak
    from geofed.bench.wan_arms import SCENARIOS, build_arms

    arms = {a.name: a for a in build_arms(SCENARIOS["steady"])}
    assert list(arms)[-6:] == ["adaptive", "adaptive-eager", "adaptive-frag-eager", "adaptive-frag-eager-spread",
                               "adaptive-frag-eager-sparseloco", "adaptive-frag-eager-ternary"]
    spread = arms["adaptive-frag-eager-spread"].cfg
    assert spread.sync.fragments == 4 and spread.sync.overlap == "eager" and spread.sync.spread_sends == 0.9
    sparse = arms["adaptive-frag-eager-sparseloco"].cfg
    assert sparse.sync.fragments == 4 and sparse.sync.overlap == "eager" and sparse.compression.codec.kind == "sparseloco"
    tern = arms["adaptive-frag-eager-ternary"].cfg
    assert tern.compression.codec.kind == "ternary" and tern.compression.ladder[0].kind == "ternary"
    # every arm is judged on its synchronised model: each round, and at per-step sync's 800 steps
    assert all(a.cfg.run.eval_every == 1 and a.cfg.run.eval_at_steps == (800,) for a in arms.values()
               if a.name != "allreduce")
    assert arms["allreduce"].cfg.run.eval_every == 10 and arms["allreduce"].cfg.run.max_steps == 800
    reps = [[_arm("allreduce", 10.0, 6e8), _arm("adaptive", 1.0, 1e6), _arm("adaptive-frag-eager", 0.5, 3e5)]]
    out = combine(reps, "steady")
    assert out["ratios"]["adaptive-frag-eager:time_vs_allreduce"] == 20.0
    assert out["ratios"]["adaptive-frag-eager:bytes_vs_allreduce"] == 2000.0
    arms = [{"name": "allreduce", "time_to_target_s": 9.0, "peak_to_mean": 1.0},
            {"name": "adaptive", "time_to_target_s": 2.0, "peak_to_mean": 3.0},
            {"name": "adaptive-frag-eager", "time_to_target_s": 1.0, "peak_to_mean": 1.2}]
    assert best_arm_peak(arms) == {"arm": "adaptive-frag-eager", "ratio": 1.2}


def _write_run(tmp_path, rounds, metrics):
    import json

    d = tmp_path / "run"
    d.mkdir()
    (d / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return d


def test_held_out_target_and_equal_examples_come_from_the_synchronised_models_evaluations(tmp_path):
    from geofed.bench.wan_results import eval_at_steps, eval_to_target, loss_ratio
    from geofed.orchestrator.report.load import load_run

    # Overlap: round r's exchange is reported by round r + 1 (exchange_round), and so is the evaluation
    # of round r's synchronised model (eval_round r, eval_t when its exchange completed).
    ev = {"metric": "loss", "higher_is_better": False}
    rounds = [
        {"round": 0, "t_start": 10.0, "t_end": 11.0, "H": 100, "mean_train_loss": 2.5},
        {"round": 1, "t_start": 11.0, "t_end": 12.0, "H": 100, "mean_train_loss": 1.9,
         "eval_avg": {**ev, "value": 2.0}, "eval_round": 0, "eval_t": 11.4},
        {"round": 2, "t_start": 12.0, "t_end": 13.0, "H": 50, "mean_train_loss": 1.8,
         "eval_avg": {**ev, "value": 1.75}, "eval_round": 1, "eval_t": 12.3},
        {"round": 3, "t_start": 13.0, "t_end": 14.0, "H": 100, "mean_train_loss": 1.7,
         "eval_avg": {**ev, "value": 1.74}, "eval_round": 2, "eval_t": 13.2},
    ]
    metrics = [{"round": r, "region": g, "bytes_sent": 0 if r == 0 else 1000 * r, "exchange_round": None if r == 0 else r - 1,
                "train_loss": 2.0, "H": 100} for r in range(4) for g in ("a", "b")]
    run = load_run(_write_run(tmp_path, rounds, metrics))
    hit = eval_to_target(run, 1.76)
    # round 1's model: its exchange (reported in round 2: 2 regions x 2000 B) and round 0's (in round 1: 2 x 1000)
    assert hit.round == 1 and hit.seconds == pytest.approx(2.3) and hit.bytes == 6000
    assert eval_to_target(run, 1.5).round is None
    assert eval_at_steps(run, 250) == 1.74 and eval_at_steps(run, 200) == 1.75 and eval_at_steps(run, 300) is None
    a = _arm("adaptive", 1.0)
    ar = _arm("allreduce", 2.0)
    assert loss_ratio(a, ar) is None  # no held-out loss at equal examples and no train loss there either
    a = ArmResult(**{**a.__dict__, "eval_at_baseline_steps": 1.734, "loss_at_baseline_steps": 2.0})
    ar = ArmResult(**{**ar.__dict__, "eval_at_baseline_steps": 1.7})
    assert loss_ratio(a, ar) == pytest.approx(1.02)  # held-out wins over the train loss


def test_a_flush_reports_two_evaluations_and_both_count(tmp_path):
    from geofed.bench.wan_results import eval_at_steps, eval_to_target
    from geofed.orchestrator.report.load import load_run
    from geofed.regions.sync.common import merge_exchange_metrics

    # A resync under overlap flushes the exchange in flight: the round's own record (round 1's model)
    # meets the flushed one (round 2's): the earlier moves aside, with its age.
    m = {"eval": {"metric": "loss", "value": 1.8, "round": 1}, "eval_age_s": 0.5, "bytes_sent": 10}
    merge_exchange_metrics(m, {"eval": {"metric": "loss", "value": 1.7, "round": 2}, "eval_age_s": 0.1, "bytes_sent": 5})
    assert m["eval"]["round"] == 2 and m["evals_earlier"] == [{"metric": "loss", "value": 1.8, "round": 1, "age_s": 0.5}]
    assert m["bytes_sent"] == 15
    ev = {"metric": "loss", "higher_is_better": False}
    rounds = [{"round": 0, "t_start": 0.0, "t_end": 1.0, "H": 100, "mean_train_loss": 2.0},
              {"round": 1, "t_start": 1.0, "t_end": 2.0, "H": 100, "mean_train_loss": 1.9, "eval_avg": {**ev, "value": 1.9},
               "eval_round": 0, "eval_t": 1.2},
              {"round": 2, "t_start": 2.0, "t_end": 3.0, "H": 100, "mean_train_loss": 1.8, "eval_avg": {**ev, "value": 1.7},
               "eval_round": 2, "eval_t": 2.9, "evals_earlier": [{"round": 1, "value": 1.75, "t": 2.5}]}]
    metrics = [{"round": r, "region": "a", "bytes_sent": 100, "exchange_round": r - 1 if r else None} for r in range(3)]
    run = load_run(_write_run(tmp_path, rounds, metrics))
    assert eval_at_steps(run, 200) == 1.75 and eval_at_steps(run, 300) == 1.7
    hit = eval_to_target(run, 1.76)
    assert hit.round == 1 and hit.seconds == pytest.approx(2.5)
