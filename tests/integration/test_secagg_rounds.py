"""Issue 22's secure aggregation on the real stack (Ray actors, mutual-TLS gRPC on 127.0.0.1, keys
signed by the regions' TLS identities): four regions sum masked int8-grid updates for two rounds;
a region that leaves mid-round (regions.emulation.availability.mid_round) does not stall the
round, the others unmask the sum of the three and hold one model, and the leaver resyncs."""

from __future__ import annotations

import pytest

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.orchestrator.driver.run import Runner

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(400)]

REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1"]


def _run(tmp_path, *, rounds: int, emulation: dict | None = None):
    cfg = config_from_mapping({
        "run": {"name": "secagg", "rounds": rounds, "report": False, "checkpoint_every": 0, "seed": 1,
                "eval_every": 0},
        "task": {"kind": "mlp-digits", "hidden": 32},
        "regions": {"names": REGIONS, "num_cpus": 0.5, **({"emulation": emulation} if emulation else {})},
        "network": {"emulation": {"mode": "none"}},
        "compression": {"codec": "int8"},
        "security": {"secure_aggregation": True, "secagg_bits": 8},
        "sync": {"policy": {"kind": "fixed", "H": 10}, "inner": {"lr": 0.003},
                 "deadline": {"initial_s": 10.0, "min_s": 5.0, "max_s": 30.0}},
    })
    runner = Runner(cfg, tmp_path, show_progress=False)
    try:
        summary = runner.run()
    finally:
        runner.shutdown()
    return summary, read_jsonl(tmp_path / "metrics.jsonl"), read_jsonl(tmp_path / "events.jsonl")


def _by_round(metrics):
    out: dict[int, dict[str, dict]] = {}
    for m in metrics:
        out.setdefault(m["round"], {})[m["region"]] = m
    return out


def test_four_regions_sum_masked_updates_over_tls_grpc(tmp_path):
    summary, metrics, _ = _run(tmp_path, rounds=2)
    rounds = _by_round(metrics)
    assert sorted(rounds) == [0, 1]
    for regions in rounds.values():
        assert sorted(regions) == sorted(REGIONS)
        for m in regions.values():
            assert m["secagg_survivors"] == 4 and m["secagg_dropped"] == [] and "secagg_failed" not in m, m
            assert m["peers_missing"] == [] and m["secagg_refused"] == {}
            assert m["secagg_levels"] == 31  # 8-bit ring, 4 regions: 127 // 4
            assert m["secagg_signed"]  # the adverts were signed and checked with the run's TLS identities
            # masked update (1 byte a value) + setup + reveal, to 3 peers
            assert m["bytes_sent"] > 3 * sum((32 * 64, 32, 32 * 10, 10))
    assert summary["eval"]["value"] > 0.3


@pytest.mark.slow  # ~30 s: three rounds of four regions
def test_a_region_leaving_mid_round_neither_stalls_nor_corrupts_the_round(tmp_path):
    drop = {"availability": {"mid_round": True,
                             "schedule": [{"region": "eu-west-1", "from_round": 1, "to_round": 1}]}}
    summary, metrics, events = _run(tmp_path, rounds=3, emulation=drop)
    rounds = _by_round(metrics)
    assert sorted(rounds) == [0, 1, 2]
    left = rounds[1]["eu-west-1"]
    assert left.get("secagg_dropped_self") and sorted(left["peers_missing"]) == sorted(set(REGIONS) - {"eu-west-1"})
    for region, m in rounds[1].items():
        if region != "eu-west-1":
            assert m["secagg_survivors"] == 3 and m["secagg_dropped"] == ["eu-west-1"], m
            assert m["peers_missing"] == []
            assert m["wait_s"] < 3 * 30.0  # three deadlines at most, never a stall
    for m in rounds[2].values():  # back in round 2, from the survivors' model
        assert m["secagg_survivors"] == 4, m
    assert any(e["event"] == "drop_mid_round" for e in events)
    assert summary["eval"]["value"] > 0.3
