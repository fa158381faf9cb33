"""RoundReport (regions/messages.py): what a region reports of a round, typed, whose to_record() is
the round's metrics.jsonl record, key for key and value for value (docs/RUNDIR.md).

Real rounds in process (regions/inprocess.py) of every golden case (tests/unit/test_golden_weights.py:
DiLoCo serial and overlapped, fragments, all-reduce, gossip/CHOCO, DP, secure aggregation), with an
evaluation and a sketch in one of them: the report Region.run_round returns holds the metrics dict the
round made (seen by a last hook's report point), and its record is that dict less the sketch.
"""

from __future__ import annotations

import pytest

from geofed.regions.hooks import RoundHook
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.messages import ExchangeStats, RoundPlan, RoundReport
from test_golden_weights import CASES, H, _cfg

# The keys every region writes every round, whatever the algorithm (docs/RUNDIR.md, metrics.jsonl).
ALWAYS = {"round", "region", "H", "codecs", "wall_s", "utilization", "rss_mb", "links", "train_loss", "steps",
          "compute_s", "step_time_s", "bytes_sent", "bytes_received", "transfers", "peers_missing",
          "send_failures", "wait_s", "sync_s", "refused", "refusals", "harmful", "quarantined", "clipped"}


class _Seen(RoundHook):
    """The round's metrics dict as the region's last report point sees it: what its report is made of."""

    def report(self, plan, metrics):
        self.metrics = dict(metrics)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_real_rounds_record_goes_through_the_report_unchanged(name, tmp_path):
    regions, extra = CASES[name]
    with InProcessRegions(_cfg(regions, extra), tmp_path / name) as group:
        seen = {reg: _Seen() for reg in regions}
        for reg, hook in seen.items():
            group.workers[reg].add_hook(hook)
        for r in range(3):
            plans = {reg: RoundPlan(round=r, H=H, evaluate=r == 1 and reg == regions[0], sketch=r == 1, final=r == 2)
                     for reg in regions}
            for reg, report in group.run_round(plans).items():
                assert isinstance(report, RoundReport)
                m = seen[reg].metrics
                record = report.to_record()
                assert record == {k: v for k, v in m.items() if k != "sketch"}, (name, r, reg)
                assert ALWAYS <= set(record), ALWAYS - set(record)
                assert (report.round, report.region, report.H) == (r, reg, H)
                assert report.exchange.bytes_sent == m["bytes_sent"]
                assert report.steps.train_loss == m["train_loss"]
                assert (report.sketch is not None) == (r == 1)
                assert (report.evaluation.eval is not None) == ("eval" in m)


def test_an_optional_key_written_as_none_stays_in_the_record():
    m = {"round": 0, "region": "a", "H": 1, "codecs": {}, "wall_s": 1.0, "utilization": 0.5, "rss_mb": 1.0,
         "links": {}, "train_loss": None, "steps": 1, "compute_s": 0.5, "step_time_s": 0.5, "bytes_sent": 0,
         "bytes_received": 0, "transfers": [], "peers_missing": [], "send_failures": {}, "wait_s": 0.0,
         "sync_s": 0.0, "refused": 0, "refusals": {}, "harmful": {}, "quarantined": {}, "clipped": {},
         "lr": None, "exchange_round": None, "fragment": 2}
    report = RoundReport.from_metrics(m)
    assert report.to_record() == m
    assert report.steps.lr is None and report.extra == {"lr": None, "exchange_round": None, "fragment": 2}


def test_a_report_without_a_key_every_round_has_is_refused():
    with pytest.raises(TypeError, match="bytes_sent"):
        RoundReport.from_metrics({"round": 0, "region": "a", "H": 1, "codecs": {}, "wall_s": 1.0, "utilization": 0.5,
                                  "rss_mb": 1.0, "links": {}, "train_loss": 0.1, "steps": 1, "compute_s": 0.5,
                                  "step_time_s": 0.5})


def test_the_drivers_marks_are_typed_and_go_back_into_the_record():
    m = {"round": 0, "region": "a", "H": 1, "codecs": {}, "wall_s": 1.0, "utilization": 0.5, "rss_mb": 1.0,
         "links": {}, "train_loss": 0.1, "steps": 1, "compute_s": 0.5, "step_time_s": 0.5, "bytes_sent": 0,
         "bytes_received": 0, "transfers": [], "peers_missing": [], "send_failures": {}, "wait_s": 0.0,
         "sync_s": 0.0, "refused": 0, "refusals": {}, "harmful": {}, "quarantined": {}, "clipped": {},
         "t_start": 1.5, "t_end": 2.5, "late": True, "exchange_round": 3}
    report = RoundReport.from_metrics(m)
    assert (report.t_start, report.t_end, report.late, report.extra) == (1.5, 2.5, True, {})
    assert report.exchange.exchange_round == 3
    assert report.to_record() == m


def test_a_flushed_exchange_outside_a_round_is_typed_too():
    """Region.flush_exchange's metrics (regions/sync/common.exchange_metrics, and the overlap's keys):
    the driver's resync reads their misses and transfers as a round's (orchestrator/driver/faults.py)."""
    more = {"bytes_sent": 10, "bytes_received": 20, "transfers": [{"peer": "b", "direction": "recv"}],
            "peers_missing": ["c"], "wait_s": 0.1, "send_failures": {}, "exchange_round": 4, "overlap_wait_s": 0.2,
            "stale_applied": []}
    ex = ExchangeStats.of(more)
    assert (ex.peers_missing, ex.exchange_round, ex.sync_s, ex.overlap_wait_s) == (["c"], 4, None, 0.2)
