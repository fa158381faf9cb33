"""The planner's arithmetic (pure) and `geofed plan` on the command line."""

from __future__ import annotations

import json
import math

import pytest

from geofed.orchestrator.cli import main
from geofed.orchestrator.plan.model import Candidate, Link, Prediction, Segment, Setup, predict, recommend, round_times
from geofed.orchestrator.policies import cost
from geofed.orchestrator.policies.types import LinkEstimate
from geofed.p2p.wan.prices import GB

MBIT = 1e6
# multi-region.yaml's bandwidth policy admits H 50..1000 and int4 only: these tests of the arithmetic
# and of the rule plan it as a fixed-H config, whose (H, codec) is what the plan is there to choose.
FIXED = ("--set", "sync.policy.kind=fixed")


def _links(bw_mbps: float, rtt_s: float, usd: float | None = 0.02) -> dict[str, Link]:
    est = LinkEstimate(bandwidth_bps=bw_mbps * MBIT, rtt_s=rtt_s)
    return {"a->b": Link(estimate=est, usd_per_gb=usd), "b->a": Link(estimate=est, usd_per_gb=usd)}


def _setup(**kw) -> Setup:
    base = dict(step_s=0.01, rounds=10, max_steps=0, overlap=False, out_links=["a->b", "b->a"],
                segments=[Segment(start=0, links=_links(8.0, 0.1))], overhead_s=0.0)
    return Setup(**{**base, **kw})


def test_serial_round_is_compute_plus_rtt_plus_bytes_over_bandwidth():
    # 1 MB at 8 Mbit/s = 1 s; RTT 0.1 s; H=100 x 10 ms = 1 s of compute.
    p = predict(_setup(), Candidate(H=100, codec="x", wire_bytes=1_000_000, codec_s=0.05))
    assert p.round_s == pytest.approx(1.0 + 0.1 + 1.0 + 0.05)
    assert p.utilization == pytest.approx(1.0 / 2.15)
    assert p.bytes_per_round == 2_000_000 and p.bytes_to_end == 20_000_000 and p.steps == 1000
    assert p.egress_usd_per_run == pytest.approx(20_000_000 / GB * 0.02)
    assert p.egress_usd_per_hour == pytest.approx(p.egress_usd_per_run / p.run_s * 3600)


def test_overlap_hides_the_exchange_behind_compute_until_it_is_longer():
    s = _setup(overlap=True, overhead_s=0.02)
    hidden = predict(s, Candidate(H=200, codec="x", wire_bytes=1_000_000))   # 2 s compute > 1.1 s sync
    exposed = predict(s, Candidate(H=50, codec="x", wire_bytes=1_000_000))   # 0.5 s compute < 1.1 s sync
    # ... and the last of the 10 rounds drains its own exchange (1.1 s) with nothing to hide it.
    assert hidden.round_s == pytest.approx(2.0 + 0.02 + 1.1 / 10) and exposed.round_s == pytest.approx(1.1 + 0.02 + 1.1 / 10)
    assert round_times(s, Candidate(H=200, codec="x", wire_bytes=1_000_000))[-2:] == pytest.approx([2.02, 3.12])
    assert hidden.bottleneck in ("a->b", "b->a")


def test_a_spread_of_round_compute_lengthens_overlapped_rounds_where_compute_and_sync_are_close():
    # 1 MB at 8 Mbit/s + 0.1 s RTT = 1.1 s of sync; H=110 x 10 ms = 1.1 s of compute on the median round.
    c = Candidate(H=110, codec="x", wire_bytes=1_000_000)
    flat = predict(_setup(overlap=True, rounds=1000), c)
    loaded = predict(_setup(overlap=True, rounds=1000, compute_spread=(0.5, 1.5)), c)
    # max(0.55, 1.1) and max(1.65, 1.1): the mean round is 1.375 s, not max(1.1, 1.1); the drain adds 1.1/1000.
    assert flat.round_s == pytest.approx(1.1 + 0.0011) and loaded.round_s == pytest.approx(1.375 + 0.0011)
    assert loaded.utilization == pytest.approx(1.1 / loaded.round_s)   # the mean compute is the median's here
    # Serial rounds pay the mean compute: the spread moves them by its mean only.
    serial = predict(_setup(compute_spread=(0.5, 2.5)), c)
    assert serial.round_s == pytest.approx(1.1 * 1.5 + 1.1)
    with pytest.raises(ValueError, match="compute_spread"):
        _setup(compute_spread=())


def test_contention_stretches_the_codec_and_the_control_plane_not_the_link():
    c = Candidate(H=100, codec="x", wire_bytes=1_000_000, codec_s=0.01)
    alone = predict(_setup(overhead_s=0.006), c)
    shared = predict(_setup(overhead_s=0.006, contention=3.0), c)
    assert alone.round_s == pytest.approx(1.0 + 1.1 + 0.01 + 0.006)
    assert shared.round_s == pytest.approx(1.0 + 1.1 + 3 * (0.01 + 0.006))   # the step time is given as shared
    with pytest.raises(ValueError, match="contention"):
        _setup(contention=0.5)


def test_the_slowest_link_is_the_bottleneck_and_an_unpriced_link_makes_dollars_unknown():
    links = _links(8.0, 0.1)
    links["b->a"] = Link(estimate=LinkEstimate(bandwidth_bps=0.8 * MBIT, rtt_s=0.1), usd_per_gb=None)
    p = predict(_setup(segments=[Segment(start=0, links=links)]), Candidate(H=10, codec="x", wire_bytes=100_000))
    assert p.bottleneck == "b->a" and p.sync_s == pytest.approx(0.1 + 1.0)
    assert p.egress_usd_per_hour is None and p.unpriced_links == ("b->a",)


def test_a_schedule_segment_and_max_steps_change_the_average_round():
    s = _setup(rounds=10, max_steps=450, segments=[Segment(start=0, links=_links(8.0, 0.0)),
                                                   Segment(start=3, links=_links(0.8, 0.0), stall_s=2.0)])
    c = Candidate(H=100, codec="x", wire_bytes=1_000_000)
    times = round_times(s, c)
    assert len(times) == 5                             # 450 steps at H=100: 5 rounds, the last cut
    assert times[:3] == pytest.approx([2.0] * 3) and times[3] == pytest.approx(1.0 + 10.0 + 2.0)
    assert predict(s, c).round_s == pytest.approx(sum(times) / 5)


def test_round_time_reuses_the_policies_cost_model():
    assert cost.round_time(1.0, 0.5, overlap=True, codec_s=0.1, overhead_s=0.05) == pytest.approx(1.05)
    assert cost.round_time(1.0, 0.5, overlap=False, codec_s=0.1, overhead_s=0.05) == pytest.approx(1.65)


def _pred(H, codec, round_s, usd_run, util):
    return Prediction(H=H, codec=codec, round_s=round_s, utilization=util, bytes_per_round=1, rounds=10, steps=10 * H,
                      bytes_to_end=10, run_s=10 * round_s, egress_usd_per_hour=usd_run / (10 * round_s) * 3600,
                      egress_usd_per_run=usd_run, bottleneck="a->b", sync_s=0.1)


def test_recommend_cheapest_per_step_above_the_floor_and_fastest_under_the_budget():
    preds = [_pred(20, "fp16", 1.0, 1.0, 0.5), _pred(100, "int8", 1.2, 0.5, 0.95), _pred(100, "topk", 1.1, 0.05, 0.96),
             _pred(400, "fp16", 4.1, 1.0, 0.99)]
    rec = recommend(preds, utilization_floor=0.9)
    assert (rec["cheapest_meeting_floor"].H, rec["cheapest_meeting_floor"].codec) == (100, "topk")  # $0.05/1000 steps
    high = recommend(preds, utilization_floor=0.97)["cheapest_meeting_floor"]
    assert (high.H, high.codec) == (400, "fp16")
    none = recommend(preds, utilization_floor=0.999)
    assert none["cheapest_meeting_floor"] is None and not none["met_floor"]
    assert (none["recommended"].H, none["recommended"].codec) == (400, "fp16")   # the fastest per step instead
    assert rec["met_floor"] and rec["recommended"] is rec["cheapest_meeting_floor"]
    fast = recommend(preds, utilization_floor=0.0, budget_usd_per_hour=100)["fastest_under_budget"]
    assert (fast.H, fast.codec) == (400, "fp16")   # 10.25 ms/step at $87.8/hour
    fast = recommend(preds, utilization_floor=0.0, budget_usd_per_hour=20)["fastest_under_budget"]
    assert (fast.H, fast.codec) == (100, "topk")   # 11 ms/step at $16.4/hour


def test_plan_cli_json_lists_candidates_with_the_issue_keys(capsys):
    assert main(["plan", "configs/multi-region.yaml", *FIXED, "--H", "50,2000", "--codecs", "int8,fp16",
                 "--step-time", "0.01", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["candidates"]) == 4 and doc["step_time_source"] == "given"
    for c in doc["candidates"]:
        assert {"round_s", "utilization", "bytes_per_round", "egress_usd_per_hour"} <= set(c)
        assert c["egress_usd_per_hour"] > 0 and 0 < c["utilization"] <= 1
    assert doc["recommended"]["cheapest_meeting_floor"] == {"H": 2000, "codec": "int8"}
    assert doc["recommendation"]["rule"] == "cheapest_meeting_floor" and doc["recommendation"]["H"] == 2000


def test_plan_without_a_candidate_at_the_floor_recommends_the_fastest_and_says_so(capsys):
    assert main(["plan", "configs/multi-region.yaml", *FIXED, "--H", "5,50", "--codecs", "fp16,int8", "--step-time", "0.001",
                 "--utilization-floor", "0.99", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommended"]["cheapest_meeting_floor"] is None
    rec, best = doc["recommendation"], max(doc["candidates"], key=lambda c: c["utilization"])
    assert (rec["H"], rec["codec"], rec["met_floor"], rec["rule"]) == (best["H"], best["codec"], False,
                                                                       "fastest_none_meets_floor")
    assert main(["plan", "configs/multi-region.yaml", *FIXED, "--H", "5,50", "--codecs", "fp16,int8", "--step-time", "0.001",
                 "--utilization-floor", "0.99"]) == 0
    assert "no candidate reaches utilisation 0.99" in capsys.readouterr().out


def test_plan_contention_scales_the_round_overhead_and_slows_rounds(capsys):
    args = ["plan", "configs/multi-region.yaml", "--H", "50", "--codecs", "int8", "--step-time", "0.01", "--json"]
    assert main(args) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*args, "--contention", "4"]) == 0
    four = json.loads(capsys.readouterr().out)
    assert four["round_overhead_s"] == pytest.approx(4 * one["round_overhead_s"]) and four["contention"] == 4
    assert four["candidates"][0]["round_s"] > one["candidates"][0]["round_s"]


def test_plan_writes_a_config_that_loads(tmp_path, capsys):
    out = tmp_path / "chosen.yaml"
    assert main(["plan", "configs/multi-region.yaml", *FIXED, "--H", "2000", "--codecs", "int8", "--step-time", "0.01",
                 "--write-config", str(out)]) == 0
    assert main(["validate", str(out)]) == 0
    assert "H=2000 codec int8" in capsys.readouterr().out


@pytest.mark.parametrize("content, key", [
    ({"links": {"us-east-1->eu-west-1": {"bandwidth_mbps": "fast", "rtt_ms": 60}}}, "links.us-east-1->eu-west-1.bandwidth_mbps"),
    ({"us-east-1->eu-west-1": {"bandwidth_mbps": 100}}, "us-east-1->eu-west-1.rtt_ms"),
    ({"us-east-1->eu-west-1": {"bandwidth_mbps": 100, "rtt_ms": 60}}, "eu-west-1->us-east-1: missing"),
])
def test_a_malformed_links_file_is_exit_2_naming_the_key(tmp_path, capsys, content, key):
    path = tmp_path / "links.json"
    path.write_text(json.dumps(content))
    rc = main(["plan", "configs/multi-region.yaml", *FIXED, "--regions", "us-east-1,eu-west-1", "--step-time", "0.01",
               "--links", str(path)])
    assert rc == 2 and f"{path}: {key}" in capsys.readouterr().err


def test_a_malformed_price_file_is_exit_2_naming_the_key(tmp_path, capsys):
    path = tmp_path / "prices.yaml"
    path.write_text("sources: {s: {url: 'https://x', as_of: '2024-01-01'}}\n"
                    "aws: {regions: {us-east-1: na}, rules: [{from: na, to: any, usd_per_gb: -1, source: s}]}\n")
    rc = main(["plan", "configs/multi-region.yaml", *FIXED, "--step-time", "0.01", "--prices", str(path)])
    assert rc == 2 and f"{path}: aws.rules.0.usd_per_gb" in capsys.readouterr().err


def test_an_adaptive_config_is_planned_inside_its_policys_range_and_ladder(capsys):
    """Issue 37 item 2: the default config's bandwidth policy may use H 50..2000 and fp16 only.
    Before, the plan recommended H=2000 top-k (a codec the run never uses) from candidates that
    included H=20; this failed with `AssertionError: assert ('topk' == 'fp16'`."""
    assert main(["plan", "configs/local-wan.yaml", "--step-time", "0.005", "--contention", "10", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    picks = [doc["recommendation"], *(r for r in doc["recommended"].values() if r is not None)]
    for r in picks:
        assert r["codec"] == "fp16" and 50 <= r["H"] <= 2000
    assert {c["H"] for c in doc["candidates"]} >= {50, 2000} and min(c["H"] for c in doc["candidates"]) == 50
    assert all(c["in_policy_range"] for c in doc["candidates"])
    # Asked for explicitly, a pair outside the range is shown but never recommended.
    assert main(["plan", "configs/local-wan.yaml", "--step-time", "0.005", "--contention", "10", "--H", "20,100",
                 "--codecs", "fp16,int8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    outside = {(c["H"], c["codec"]) for c in doc["candidates"] if not c["in_policy_range"]}
    assert outside == {(20, "fp16"), (20, "int8"), (100, "int8")}
    assert (doc["recommendation"]["H"], doc["recommendation"]["codec"]) not in outside


def test_the_plan_says_which_H_and_codec_the_runs_policy_settles_on(capsys):
    """The run's bandwidth policy sizes H so that the control plane (0.006 s x contention 10) stays
    under 10% of a round (H*step >= 9 x 0.06 s) and the exchange hides behind compute (H*step >=
    1.5 x sync). Before, the plan had no `policy` in its document (KeyError) and predicted H=150 at
    24% utilisation where the run's policy picked H 55-146 and had 96%."""
    assert main(["plan", "configs/local-wan.yaml", "--step-time", "0.005", "--contention", "10", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    pol = doc["policy"]
    sync = next(c["sync_s"] for c in doc["candidates"] if c["codec"] == "fp16")
    want = max(math.ceil(9 * 0.06 / 0.005 - 1e-9), math.ceil(1.5 * sync / 0.005 - 1e-9))
    assert (pol["kind"], pol["H"], pol["codec"], pol["H_min"], pol["H_max"]) == ("bandwidth", want, "fp16", 50, 2000)
    assert pol["prediction"]["H"] == want and 0.85 <= pol["prediction"]["utilization"] <= 1.0
    assert main(["plan", "configs/local-wan.yaml", "--step-time", "0.005", "--contention", "10"]) == 0
    assert f"settles at H={want} codec fp16" in capsys.readouterr().out


def test_a_local_plan_times_the_step_in_one_process_per_region_at_once():
    """The contention of co-located regions is measured: one process per region, started together,
    their timing windows overlapping; the plan's step is the slowest's mean and its contention that
    over the alone probe. Before, the plan timed one step alone (0.41 ms where the default run's
    regions stepped 2.5-6.6 ms) and took contention 1: ModuleNotFoundError (no plan.probe)."""
    from geofed.orchestrator.config import load_config
    from geofed.orchestrator.plan import plan

    cfg = load_config("configs/local-wan.yaml", ["regions.names=[us-east-1,eu-west-1]"])
    doc = plan(cfg, Hs=[50])
    probe = doc["step_probe"]
    a, b = probe["per_copy"]
    assert a["start"] < b["end"] and b["start"] < a["end"]          # they stepped at the same time
    assert probe["shared_s"] == max(a["mean_s"], b["mean_s"]) and probe["torch_threads"] == cfg.regions.torch_threads
    assert probe["copies"] == 2 and doc["step_time_s"] >= probe["alone_s"]
    assert doc["contention"] == pytest.approx(doc["step_time_s"] / probe["alone_s"])
    assert doc["round_overhead_s"] == pytest.approx(0.006 * doc["contention"])
    # A cluster (ray.address): a node per region, nothing shared here to measure.
    cluster = plan(load_config("configs/local-wan.yaml", ["ray.address=auto"]), Hs=[50])
    assert cluster["contention"] == 1.0 and cluster["step_probe"]["copies"] is None
    assert cluster["step_time_s"] == cluster["step_probe"]["alone_s"]


def test_a_clusters_step_time_is_given_per_region_and_the_slowest_paces_the_plan(capsys):
    """On a cluster each node measures its own step (docs/plan.md); the rounds wait for the slowest
    region, so the plan takes the slowest. A region left out (or one not planned) is exit 2 naming
    it. Before, --step-time took one number only: exit 2, "invalid float value"."""
    base = ["plan", "configs/local-wan.yaml", "--contention", "1", "--json", "--step-time"]
    per = "us-east-1=0.002,eu-west-1=0.004,ap-northeast-1=0.003,eu-central-1=0.002"
    assert main([*base, per]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step_time_s"] == 0.004 and doc["step_time_source"] == "given"
    assert main([*base, "us-east-1=0.002,eu-west-1=0.004"]) == 2
    assert "--step-time: no step time for region(s) ap-northeast-1, eu-central-1" in capsys.readouterr().err
    assert main([*base, per + ",us-west-2=0.001"]) == 2
    assert "us-west-2 not among the planned regions" in capsys.readouterr().err
    assert main([*base, "us-east-1=fast"]) == 2


def test_plan_address_plans_a_cluster_run_as_geofed_run_address_makes_it(capsys):
    """multi-region.yaml leaves ray.address null and is run with `geofed run --address HEAD:6379`: a
    node per region, nothing shared here to measure. Before, `geofed plan` had no --address (exit 2)
    and, with the new co-located probe, would have timed its regions as if on this host."""
    assert main(["plan", "configs/multi-region.yaml", "--address", "10.0.0.1:6379", "--H", "100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["contention"] == 1.0 and doc["step_probe"]["copies"] is None
    assert doc["step_time_source"].startswith("probe (alone")
