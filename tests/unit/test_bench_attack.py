"""`geofed bench attack` (issue 36, item 7): the hostile member's hooks (benchmarks/bench/adversary.py) on real
workers over the in-memory transport, and the bench's arms, order, accounting, medians and targets
(benchmarks/bench/attack_results.py) on synthetic run directories.

New code: none of these existed before (each test failed with ModuleNotFoundError on
geofed.bench.adversary / geofed.bench.attack_results).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from geofed.bench import attack_results as ar
from geofed.bench.adversary import Adversary, HostileMember, attach, poisoned_state_bytes
from geofed.bench.attack import arm_config, main
from geofed.orchestrator.config import config_from_mapping
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.messages import RoundPlan

REGIONS = ["a", "b", "c"]
BAD = "b"


def _cfg():
    return config_from_mapping({
        "run": {"name": "t", "seed": 1},
        "task": {"kind": "mlp-digits", "hidden": 16},
        "regions": {"names": REGIONS},
        "sync": {"inner": {"lr": 0.01}, "deadline": {"initial_s": 2.0, "min_s": 0.5, "max_s": 2.0}},
        "compression": {"codec": "identity"},
        "network": {"emulation": {"mode": "none"}}})


def _rounds(group, n, start=0):
    """n rounds' records by region (the hostile member's `hostile` key is in their extra)."""
    return [{reg: m.to_record() for reg, m in group.run_round({r: RoundPlan(round=i, H=3) for r in REGIONS}).items()}
            for i in range(start, start + n)]


# ---- the spec and the hooks --------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{"kind": "lie"}, {"kind": "scale", "factor": math.inf},
                                    {"kind": "scale", "factor": True}, {"kind": "withhold", "from_round": -1}])
def test_adversary_refuses_a_bad_spec_naming_the_field(kwargs):
    with pytest.raises(ValueError, match=r"Adversary\.(kind|factor|from_round)"):
        Adversary(**kwargs)


def test_adversary_is_frozen_and_keyword_only():
    a = Adversary(kind="scale", factor=-9.0)
    with pytest.raises(AttributeError):
        a.factor = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        Adversary("scale")  # type: ignore[misc]


def test_flip_at_the_bound_is_norm_multiple_times_the_median_of_its_own_norms():
    m = HostileMember(Adversary(kind="bound", factor=-1.0), norm_multiple=10.0)
    for norm in (1.0, 3.0):  # rounds before: its own honest updates
        m.outgoing(0, [torch.full((4,), norm / 2)], ["x"])  # ||(n/2, n/2, n/2, n/2)|| = n
    sent, peers = m.outgoing(2, [torch.full((4,), 1.0)], ["x", "y"])  # norm 2: median of 1, 3, 2 is 2
    assert peers == ["x", "y"]
    assert torch.allclose(sent[0], torch.full((4,), -10.0))  # -(10 x 2) / 2 per value: norm 20, flipped
    assert m.take_acts() == {"flipped": 4} and m.take_acts() == {}  # 2 rounds x 2 peers, then reset


def test_scale_withhold_and_from_round():
    m = HostileMember(Adversary(kind="scale", factor=9.0, from_round=1), norm_multiple=10.0)
    t = [torch.ones(3)]
    assert m.outgoing(0, t, ["x"])[0] is t  # honest before from_round
    assert torch.equal(m.outgoing(1, t, ["x"])[0][0], torch.full((3,), 9.0))
    w = HostileMember(Adversary(kind="withhold"), norm_multiple=10.0)
    assert w.outgoing(0, t, ["x", "y"])[1] == [] and w.take_acts() == {"withheld": 2}
    s = HostileMember(Adversary(kind="secagg", factor=1e30), norm_multiple=10.0)
    assert s.outgoing(0, t, ["x"]) == (t, ["x"])  # its plain pushes stay honest; the masked one lies
    assert float(s.masked(0, [torch.ones(2)], ["x", "y"])[0][0]) == pytest.approx(1e30)
    assert s.take_acts() == {"secagg_scaled": 2}


def test_poisoned_state_keeps_the_layout_and_replaces_every_float():
    state = {"round": 4, "model": {"w": torch.zeros(3, 2), "steps": torch.tensor(5)},
             "algorithm": {"global": [torch.zeros(3)], "outer": {"state": {0: {"momentum_buffer": torch.zeros(3)}},
                                                                "param_groups": [{"lr": 0.7, "params": [0]}]}}}
    buf = io.BytesIO()
    torch.save(state, buf)
    out = torch.load(io.BytesIO(poisoned_state_bytes(buf.getvalue(), torch.Generator().manual_seed(0))),
                     weights_only=True)
    assert out["round"] == 4 and torch.equal(out["model"]["steps"], torch.tensor(5))
    for t in (out["model"]["w"], out["algorithm"]["global"][0], out["algorithm"]["outer"]["state"][0]["momentum_buffer"]):
        assert torch.isfinite(t).all() and t.abs().sum() > 0
    assert out["algorithm"]["outer"]["param_groups"] == [{"lr": 0.7, "params": [0]}]


def test_a_withholding_member_receives_everything_and_the_others_miss_it(tmp_path):
    with InProcessRegions(_cfg(), tmp_path) as group:
        member = attach(Adversary(kind="withhold"), group.workers[BAD])
        group.workers[BAD].plugin = member
        out = _rounds(group, 2)
    for res in out:
        assert res[BAD]["peers_missing"] == [] and res[BAD]["bytes_sent"] == 0
        assert res[BAD]["hostile"] == {"withheld": 2}
        assert all(res[r]["peers_missing"] == [BAD] for r in REGIONS if r != BAD)


def test_a_scaled_update_reaches_the_peers_as_sent(tmp_path):
    """x1e10 on a first update of ~0.01 values: past security.max_update_value (1e6), so each honest
    region refuses it as out_of_bounds; the member's own model stays its honest one."""
    with InProcessRegions(_cfg(), tmp_path) as group:
        group.workers[BAD].plugin = attach(Adversary(kind="scale", factor=1e10), group.workers[BAD])
        res = _rounds(group, 1)[0]
    assert res[BAD]["hostile"] == {"scaled": 2}
    for r in REGIONS:
        if r != BAD:
            assert res[r]["refusals"].get("out_of_bounds") == 1, res[r]["refusals"]
    assert res[BAD]["peers_missing"] == [] and math.isfinite(res[BAD]["train_loss"])


def test_a_poisoned_member_serves_a_random_state_on_fetch_state(tmp_path):
    with InProcessRegions(_cfg(), tmp_path) as group:
        group.workers[BAD].plugin = attach(Adversary(kind="poisoned"), group.workers[BAD])
        _rounds(group, 1)
        honest = [g.clone() for g in group.workers[BAD].algorithm.eval_params()]
        donor, _ = group.workers["a"].catch_up([BAD])
        taken = group.workers["a"].algorithm.eval_params()
        assert donor == BAD and group.workers[BAD].plugin.take_acts() == {"poisoned_state": 1}
        assert all(torch.isfinite(t).all() for t in taken)
        assert not any(torch.allclose(t, h) for t, h in zip(taken, honest))


def test_the_member_plugs_in_through_the_regions_plugin_and_the_core_names_no_attacker(tmp_path):
    """Region(plugin=Adversary(...)) attaches the member through public seams (add_hook,
    serve_state, contribution_hooks); no code name in regions/, p2p/ or compression/ says hostile or
    adversary (they said so in the Exchanger's and SecAggRound's slots before the bench's move)."""
    import tokenize

    from geofed.p2p.memory import InMemoryHub, InMemoryTransport
    from geofed.regions.region import Region

    region = Region(_cfg(), "a", tmp_path, transport=InMemoryTransport("a", InMemoryHub()),
                    plugin=Adversary(kind="withhold"))
    try:
        assert isinstance(region.plugin, HostileMember) and region.exchanger.before_send is not None
    finally:
        region.close()
    root = Path(__file__).resolve().parents[2]
    names = []
    for room in ("regions", "p2p", "compression"):
        for f in sorted((root / room).rglob("*.py")):
            with f.open("rb") as fh:
                names += [f"{f.name}:{t.start[0]} {t.string}" for t in tokenize.tokenize(fh.readline)
                          if t.type == tokenize.NAME and any(w in t.string.lower() for w in ("hostile", "adversar"))]
    assert names == []


# ---- the bench's arms and order ----------------------------------------------------------

def test_arms_name_each_attack_of_the_issue():
    names = [a.name for a in ar.ARMS]
    for word in ("withhold", "poisoned", "flip", "secagg"):
        assert any(word in n for n in names), word
    assert len(names) == 6 and len(set(names)) == 6
    assert [a.name for a in ar.ARMS if a.secagg] == ["secagg_x1e30"]
    kinds = {a.name: (a.adversary.kind, a.adversary.factor) for a in ar.ARMS}
    assert kinds["flip_x-9"] == ("scale", -9.0) and kinds["scale_x+9"] == ("scale", 9.0)
    assert kinds["flip_bound"] == ("bound", -1.0) and kinds["secagg_x1e30"] == ("secagg", 1e30)


def test_select_arms_by_name_or_word_and_refuses_unknown():
    assert [a.name for a in ar.select_arms("flip")] == ["flip_bound", "flip_x-9"]
    assert [a.name for a in ar.select_arms("secagg_x1e30,withhold")] == ["withhold", "withhold_poisoned",
                                                                         "secagg_x1e30"]
    assert len(ar.select_arms("")) == 6
    with pytest.raises(ValueError, match="--arms: bogus"):
        ar.select_arms("flip,bogus")


def test_run_order_interleaves_baselines_and_arms_rotating_the_start():
    arms = ar.select_arms("flip_bound,secagg_x1e30")
    order = [(rep, a.name) for rep, a in ar.run_order(arms, 3)]
    first = ["undisturbed", "undisturbed_secagg", "flip_bound", "secagg_x1e30"]
    assert order[:4] == [(0, n) for n in first]
    assert order[4:8] == [(1, n) for n in first[1:] + first[:1]]
    assert order[8:] == [(2, n) for n in first[2:] + first[:2]]
    assert [a.name for _, a in ar.run_order(ar.select_arms("flip_bound"), 1)] == ["undisturbed", "flip_bound"]


def test_secagg_arms_run_under_secure_aggregation_and_no_config_key_turns_a_region_hostile():
    plain, sec = arm_config(ar.BY_NAME["flip_bound"], rounds=2, H=3), arm_config(ar.BY_NAME["secagg_x1e30"], rounds=2, H=3)
    assert not plain.security.secure_aggregation and sec.security.secure_aggregation
    assert sec.compression.codec.key == "int8" and sec.security.secagg_bits == 8
    assert "hostile" not in json.dumps(str(plain)) and "adversary" not in json.dumps(str(plain))


# ---- one run's accounting, from its directory --------------------------------------------

def _run_dir(tmp_path: Path, name: str, *, metrics: list[dict], summary: dict | None) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (d / "rounds.jsonl").write_text("".join(json.dumps({"round": m["round"], "t_end": 1.0 + m["round"]}) + "\n"
                                            for m in metrics if m["region"] == "us-east-1"))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    return d


def _summary(values: dict[str, float], *, wall_s: float, by_reason=None, by_region=None, resyncs=0):
    return {"wall_s": wall_s, "eval_per_region": {r: {"metric": "accuracy", "value": v, "higher_is_better": True}
                                                  for r, v in values.items()},
            "refusals": {"by_reason": by_reason or {}, "by_region": by_region or {}}, "faults": {"resyncs": resyncs}}


def _m(region, round_, **kw):
    return {"region": region, "round": round_, "refusals": {}, "clipped": {}, "peers_missing": [], **kw}


ACC = {"us-east-1": 0.97, "eu-west-1": 0.10, "ap-northeast-1": 0.95, "eu-central-1": 0.96}


def test_from_run_dir_counts_the_members_acts_and_what_the_honest_regions_caught(tmp_path):
    bad = ar.ATTACKER
    metrics = [_m(bad, 0, hostile={"flipped": 3}, refusals={"late": 5}),
               _m("us-east-1", 0, clipped={bad: 1, "eu-central-1": 1}),
               _m("ap-northeast-1", 0, refusals={"outlier": 1, "late": 2}),
               _m("eu-central-1", 0, peers_missing=[bad]),
               _m(bad, 1, hostile={"flipped": 3})]
    d = _run_dir(tmp_path, "flip", metrics=metrics, summary=_summary(ACC, wall_s=12.0, resyncs=2))
    res = ar.from_run_dir("flip_bound", 0, d)
    assert res.acts == {"flipped": 6} and res.acts_total == 6
    # the member's own refusals and clips of honest peers are not counted; late is shown, not credited;
    # a miss credits only withheld pushes
    assert res.refusals == {"clipped": 1, "outlier": 1, "late": 2, "missed": 1}
    assert res.counted == 2
    assert res.honest_metric == pytest.approx((0.97 + 0.95 + 0.96) / 3)  # the member's own accuracy left out
    assert (res.died, res.wall_s, res.rounds, res.resyncs) == (False, 12.0, 2, 2)


def test_withheld_pushes_are_credited_by_the_misses_and_secagg_refusals_by_the_last_record(tmp_path):
    bad = ar.ATTACKER
    metrics = [_m(bad, 0, hostile={"withheld": 3}), _m(bad, 1, hostile={"withheld": 3}),
               *[_m(r, i, peers_missing=[bad]) for r in ("us-east-1", "ap-northeast-1", "eu-central-1") for i in (0, 1)],
               _m("us-east-1", 1, secagg_refused={"wrong_grid": 1}), _m("us-east-1", 2, secagg_refused={"wrong_grid": 2})]
    res = ar.from_run_dir("withhold", 0, _run_dir(tmp_path, "w", metrics=metrics, summary=_summary(ACC, wall_s=3.0)))
    assert res.refusals == {"missed": 6, "secagg_wrong_grid": 2}
    assert res.counted == 6 + 2


def test_a_secagg_refusal_the_transport_counted_too_is_counted_once(tmp_path):
    """Before f276061 this counted 9: each out_of_bounds once as the transport's and once as secure aggregation's."""
    bad = ar.ATTACKER
    metrics = [_m(bad, 0, hostile={"secagg_scaled": 3}),
               *[_m(r, 0, refusals={"out_of_bounds": 1}, secagg_refused={"out_of_bounds": 1, "wrong_grid": 1})
                 for r in ("us-east-1", "ap-northeast-1", "eu-central-1")]]
    res = ar.from_run_dir("secagg_x1e30", 0, _run_dir(tmp_path, "s", metrics=metrics, summary=_summary(ACC, wall_s=3.0)))
    assert res.refusals == {"out_of_bounds": 3, "secagg_out_of_bounds": 3, "secagg_wrong_grid": 3}
    assert res.counted == 3 + 3  # out_of_bounds once, wrong_grid (secure aggregation's alone)


def test_a_run_that_died_has_no_metric_and_the_wall_time_of_its_last_round(tmp_path):
    metrics = [_m("us-east-1", 0), _m("us-east-1", 1), _m(ar.ATTACKER, 1, hostile={"secagg_scaled": 3})]
    d = _run_dir(tmp_path, "dead", metrics=metrics, summary=None)
    res = ar.from_run_dir("secagg_x1e30", 0, d, error="RunFailed: x")
    assert res.died and res.honest_metric is None and res.wall_s == 2.0 and res.error == "RunFailed: x"
    assert ar.from_run_dir("secagg_x1e30", 0, d).died  # no summary.json: died as well


def test_the_whole_runs_refusals_add_reasons_the_rounds_do_not_have(tmp_path):
    metrics = [_m("us-east-1", 0, refusals={"outlier": 1}), _m(ar.ATTACKER, 0, hostile={"poisoned_state": 2})]
    summary = _summary(ACC, wall_s=1.0, by_reason={"outlier": 1, "donor_refused": 2}, by_region={"us-east-1": 3})
    res = ar.from_run_dir("withhold_poisoned", 0, _run_dir(tmp_path, "p", metrics=metrics, summary=summary))
    assert res.refusals == {"outlier": 1, "donor_refused": 2} and res.counted == 3


# ---- medians, spread, targets, the document ----------------------------------------------

def _result(name, rep, *, metric, wall, died=False, acts=None, counted=0, refusals=None):
    return ar.RunResult(name=name, rep=rep, died=died, wall_s=wall, honest_metric=metric, acts=acts or {},
                        counted=counted, refusals=refusals or {})


def test_rows_compare_each_arm_with_its_own_baseline_of_the_same_repetition():
    arms = ar.select_arms("flip_bound,secagg_x1e30")
    results = [_result("undisturbed", 0, metric=0.97, wall=10.0), _result("undisturbed_secagg", 0, metric=0.95, wall=20.0),
               _result("flip_bound", 0, metric=0.90, wall=15.0, acts={"flipped": 3}, counted=3),
               _result("secagg_x1e30", 0, metric=None, wall=2.0, died=True, acts={"secagg_scaled": 3})]
    (rows,) = ar.arm_rows(results, arms)
    flip, sec = rows
    assert flip["metric_delta_points"] == pytest.approx(-7.0) and flip["time_ratio"] == 1.5
    assert sec["metric_delta_points"] is None and sec["time_ratio"] == 0.1 and sec["died"]


def test_combine_gives_medians_spread_and_the_targets_per_arm():
    rows = [[{"name": "flip_bound", "metric_delta_points": d, "time_ratio": t, "died": False,
              "refusals": {"clipped": c}, "acts": {"flipped": 9}, "counted": c, "acts_total": 9, "cut": False}]
            for d, t, c in ((-0.5, 1.0, 9), (-3.0, 1.2, 9), (0.2, 1.6, 9))]
    doc = ar.combine(rows)
    assert doc["reps"] == 3 and set(doc) >= {"arms", "reps", "spread"}
    (arm,) = doc["arms"]
    assert {"name", "metric_delta_points", "time_ratio", "died", "refusals"} <= set(arm)
    assert (arm["metric_delta_points"], arm["time_ratio"], arm["died"]) == (-0.5, 1.2, False)
    assert arm["refusals"] == {"clipped": 9}
    assert doc["spread"]["flip_bound"]["metric_delta_points"] == {"min": -3.0, "max": 0.2, "n": 3}
    assert doc["spread"]["flip_bound"]["time_ratio"] == {"min": 1.0, "max": 1.6, "n": 3}
    assert arm["targets"] == {"metric": True, "time": True, "alive": True, "counted": True, "all": True}
    assert doc["targets"]["held"] == {"flip_bound": True}


@pytest.mark.parametrize("change, failed", [
    ({"metric_delta_points": -1.01}, "metric"), ({"metric_delta_points": None}, "metric"),
    ({"time_ratio": 1.51}, "time"), ({"died": True}, "alive"), ({"all_counted_reps": 2}, "counted"),
    ({"acts_total": 0, "all_counted_reps": 3}, "counted"),
])
def test_judge_fails_exactly_the_target_missed(change, failed):
    arm = {"metric_delta_points": 0.5, "time_ratio": 1.5, "died": False, "acts_total": 9, "all_counted_reps": 3, **change}
    got = ar.judge(arm, n_reps=3)
    assert [k for k, v in got.items() if not v] == [failed, "all"]


def test_table_marks_each_target():
    rows = [[{"name": "withhold", "metric_delta_points": -0.2, "time_ratio": 9.0, "died": False,
              "refusals": {"missed": 57}, "acts": {"withheld": 57}, "counted": 57, "acts_total": 57, "cut": False}]]
    text = ar.table(ar.combine(rows))
    assert "withhold" in text and "+-++" in text and "missed 57" in text


def test_cli_refuses_bad_options_with_exit_2(tmp_path, capsys):
    assert main(["--arms", "nosuch"]) == 2
    assert "--arms: nosuch names no arm" in capsys.readouterr().err
    assert main(["--reps", "0"]) == 2
    (tmp_path / "x").write_text("")
    assert main(["--out", str(tmp_path)]) == 2
    assert "is not empty" in capsys.readouterr().err
