"""Issue 41, membership over the session's Ray (mutual-TLS gRPC, 3 regions, digits, DiLoCo), one
run asserted several ways (orchestrator/driver/membership.py):
- `geofed leave RUN_DIR NAME` asks the live run's driver through RUN_DIR/control; the region
  delivers its round, leaves for good (its process ends, no restart) and the others go on,
  planned without it;
- `geofed join RUN_DIR --region NAME` brings it back in a new actor that takes the current model
  from a peer (the rejoin path) and is planned from the next round: at the end it holds its
  peers' model;
- a SIGTERM to another region's process (a spot notice, regions/leave_notice.py) makes it leave
  after its round within regions.leave_grace_s; the run's own end logs no leave.
events.jsonl, rounds.jsonl and summary.json say all of it."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import pytest
from geofed.orchestrator.cli import main
from geofed.orchestrator.driver.membership import EXIT
from geofed.orchestrator.driver.rundir import read_json_file, read_jsonl
from geofed.regions.emulation import ComputeEmulation
from reliability_harness import REGIONS3, BackgroundRun, events, pid_alive, small_config, wait_for

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300),
              pytest.mark.slow]  # slow: real runs over Ray, 26-41 s and ~20 s after Ray's start on the loaded 2-core host

LEAVER = "eu-west-1"  # leaves by request, then joins again
SPOT = "ap-northeast-1"  # gets the SIGTERM
STAYS = "us-east-1"
ROUNDS = 22
GROW_ROUNDS = 30  # the join under a new name's run: the label join ahead of it no longer holds the rounds (AwaitingNode), so the join comes later
# Every region's steps are slowed (a sleep after each, no CPU) so that a round lasts about a second
# on any host: the join's new actor (a fresh process that imports torch) starts while the rounds go
# on, so it costs a few rounds (more on a loaded host: hence the rounds to spare), not the rest of
# the run, and the SIGTERM lands with rounds to go (a CI run on a quiet host once finished all 14
# of its unslowed rounds before the notice came).
PACE = ComputeEmulation(slowdown={r: 40.0 for r in REGIONS3})


def _ask(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_regions_leave_by_request_and_by_sigterm_and_join_again_while_the_run_goes_on(tmp_path, capsys):
    cfg = small_config(rounds=ROUNDS, H=5, run={"name": "members", "rounds": ROUNDS, "checkpoint_every": 0},
                       sync={"deadline": {"initial_s": 2.0, "min_s": 0.5, "max_s": 3.0}})
    cfg = dataclasses.replace(cfg, regions=dataclasses.replace(cfg.regions, emulation=PACE))
    run = BackgroundRun(cfg, tmp_path / "run").start()
    run.wait_rounds(2, timeout_s=120)
    first_pid = run.runner.actors.info[LEAVER]["pid"]
    left = _ask(capsys, "leave", str(run.run_dir), LEAVER, "--wait", "60")
    assert left["event"] == "region_left" and left["region"] == LEAVER and left["why"] == "request"
    assert left["alive"] == [STAYS, SPOT]
    run.wait_rounds(left["last_round"] + 2, timeout_s=60)  # a round without it
    joined = _ask(capsys, "join", str(run.run_dir), "--region", LEAVER, "--wait", "120")
    assert joined["event"] == "region_joined" and joined["region"] == LEAVER and joined["alive"] == REGIONS3
    assert joined["pid"] != first_pid
    spot_pid = run.runner.actors.info[SPOT]["pid"]
    os.kill(spot_pid, signal.SIGTERM)
    rounds_at_sigterm = len(read_jsonl(run.run_dir / "rounds.jsonl"))
    summary = run.join(timeout_s=200)
    assert run.error is None, run.error
    left_after, back_from = left["last_round"], joined["first_round"]

    # The SIGTERM's region finished its round within the grace and left after it.
    spot = [e for e in events(run.run_dir, "region_left") if e["region"] == SPOT]
    assert len(spot) == 1 and spot[0]["why"] == "sigterm" and spot[0]["was_alive"], (
        rounds_at_sigterm, [m for m in read_jsonl(run.run_dir / "metrics.jsonl") if m["region"] == SPOT][-2:],
        read_jsonl(run.run_dir / "events.jsonl")[-12:])
    assert spot[0]["alive"] == [STAYS, LEAVER] and 0 < spot[0]["grace_left_s"] <= 30
    spot_after = spot[0]["last_round"]
    assert back_from <= spot_after < ROUNDS - 1, (back_from, spot_after)

    # The joiner took a peer's state through the rejoin path; the leavers' processes are gone for good.
    rejoined = events(run.run_dir, "region_rejoined")
    assert [(e["region"], e["after"]) for e in rejoined] == [(LEAVER, "join")] and rejoined[0]["donor"] in (STAYS, SPOT)
    for gone in (first_pid, spot_pid):
        wait_for(lambda gone=gone: not pid_alive(gone), 20, f"the leaver's process {gone} to end")
    assert not events(run.run_dir, "region_failed") and not events(run.run_dir, "control_refused")
    probed = [e for e in events(run.run_dir, "links_probed") if e.get("after") == "join"]
    # Back under its old name: its links were measured at set-up, so they are not probed again (run._probe)
    assert len(probed) == 1 and probed[0]["probes"] == {} and LEAVER in probed[0]["skipped"], probed
    assert probed[0]["round"] == back_from
    assert all(f"{a}->{b}" in probed[0]["links"] for a in REGIONS3 for b in REGIONS3 if a != b), probed[0]["links"]
    assert set(run.runner.actors.handles) == {STAYS, LEAVER}

    # Who ran each round, and who was planned: nobody waited for or mixed a region that was out.
    rounds = read_jsonl(run.run_dir / "rounds.jsonl")
    assert [r["round"] for r in rounds] == list(range(ROUNDS))
    for rec in rounds:
        r = rec["round"]
        expect = (REGIONS3 if r <= left_after or back_from <= r <= spot_after else
                  [STAYS, SPOT] if r < back_from else [STAYS, LEAVER])
        assert rec["alive"] == expect and rec["regions_reported"] == sorted(expect), r
        out = set(REGIONS3) - set(expect)
        assert rec["codecs"] and not any(reg in link for link in rec["codecs"] for reg in out), rec["codecs"]
    metrics = read_jsonl(run.run_dir / "metrics.jsonl")
    assert sorted({m["round"] for m in metrics if m["region"] == LEAVER}) == (
        list(range(left_after + 1)) + list(range(back_from, ROUNDS)))
    assert max(m["round"] for m in metrics if m["region"] == SPOT) == spot_after
    assert [m["round"] for m in metrics if m.get("leaving")] == [spot_after]  # its report carried the notice

    # The summary names them; the final evaluation is of the two at the end, which hold one model
    # (DiLoCo over full: a joiner that had not taken its peers' state would stay apart for good).
    assert summary == read_json_file(run.run_dir / "summary.json")
    assert summary["left"] == {LEAVER: {"round": left_after, "why": "request", "request": left["request"]},
                               SPOT: {"round": spot_after, "why": "sigterm", "request": None}}
    assert summary["joined"] == {LEAVER: {"round": back_from, "request": joined["request"]}}
    assert set(summary["eval_per_region"]) == {STAYS, LEAVER} and summary["eval"]["value"] > 0.3
    assert summary["consensus_distance"] < 1e-4  # sketch rounding
    assert len(events(run.run_dir, "region_left")) == 2  # the run's own end retired nobody
    assert summary["faults"]["region_rounds_out"] == 0  # leaving is no fault
    assert [rec.get("members_out", []) for rec in rounds] == [
        [] if rec["round"] <= left_after else [LEAVER] if rec["round"] < back_from else
        [] if rec["round"] <= spot_after else [SPOT] for rec in rounds]


def test_a_sigterm_whose_grace_runs_out_mid_round_retires_the_region_at_once(tmp_path):
    """The spot region's round 0 lasts 10 s or more (regions.emulation.slowdown 1000: a step of 1 ms
    takes 1 s); a SIGTERM a second into it with regions.leave_grace_s 4 ends its process mid-round.
    The driver heard the notice from its heartbeat (one a second while it waits), so the death is no
    failure and Ray's restart does not bring it back: it is retired before round 1 (was_alive false)
    and the other region goes on alone."""
    regions = [STAYS, SPOT]
    cfg = small_config(regions=regions, rounds=4, H=10, run={"name": "grace", "rounds": 4, "checkpoint_every": 0},
                       sync={"deadline": {"initial_s": 2.0, "min_s": 0.5, "max_s": 3.0}})
    cfg = dataclasses.replace(cfg, regions=dataclasses.replace(
        cfg.regions, leave_grace_s=4.0, emulation=ComputeEmulation(slowdown={SPOT: 1000.0})))
    run = BackgroundRun(cfg, tmp_path / "run").start()
    wait_for(lambda: bool(events(run.run_dir, "setup_done")), 120, "the run's set-up")
    time.sleep(1.0)  # round 0 under way
    pid = run.runner.actors.info[SPOT]["pid"]
    os.kill(pid, signal.SIGTERM)
    summary = run.join(timeout_s=150)
    assert run.error is None, run.error
    left = events(run.run_dir, "region_left")
    assert [(e["region"], e["why"], e["was_alive"], e["last_round"]) for e in left] == [(SPOT, "sigterm", False, 0)], left
    assert not pid_alive(pid)
    assert not events(run.run_dir, "region_failed") and not events(run.run_dir, "region_rejoined")
    rounds = read_jsonl(run.run_dir / "rounds.jsonl")
    assert [r["regions_reported"] for r in rounds] == [[STAYS]] * 4  # it never finished its round 0
    assert not [m for m in read_jsonl(run.run_dir / "metrics.jsonl") if m["region"] == SPOT]
    assert summary["left"] == {SPOT: {"round": 0, "why": "sigterm", "request": None}}
    assert summary["faults"]["region_restarts"] == 0 and summary["faults"]["region_failures"] == 0
    assert set(run.runner.actors.handles) == {STAYS}


def test_a_region_joins_under_a_new_name_and_holds_its_peers_model_after_its_join_round(tmp_path, capsys):
    """Two regions, then `geofed join RUN_DIR --region NEW` mid-run (issue 41, item 1): the run's CA
    issues NEW's certificate, the emulator adds its links (network.emulation.default: no region is
    placed by its label), its links are probed before they carry updates, it takes its peers' state
    and is planned from the next round over three regions. Before it, a join on a label no node has
    is refused once regions.placement_timeout_s passes, and the run goes on."""
    new = "sa-east-1"
    regions = [STAYS, SPOT]
    # The joiner is not slowed (regions.emulation names the config's regions only): it waits for its
    # slowed peers' updates, about a second a round, several on a loaded host. Its deadline learns
    # from those waits; shrunk below a slow round's it missed a peer's update (muted as withholding
    # once, apart in the last round once): min_s keeps it above them; a round ends once all arrive.
    cfg = small_config(regions=regions, rounds=GROW_ROUNDS, H=5, run={"name": "grow", "rounds": GROW_ROUNDS, "checkpoint_every": 0,
                                                           "eval_every": 1},  # each round's consensus distance
                       sync={"deadline": {"initial_s": 8.0, "min_s": 8.0, "max_s": 10.0}},
                       network={"emulation": {"mode": "proxy", "preset": None,
                                              "default": {"latency_ms": 2.0, "bandwidth_mbps": 400.0}}})
    cfg = dataclasses.replace(cfg, regions=dataclasses.replace(
        cfg.regions, placement_timeout_s=1.0, emulation=ComputeEmulation(slowdown={r: 40.0 for r in regions})))
    run = BackgroundRun(cfg, tmp_path / "run").start()
    run.wait_rounds(2, timeout_s=120)
    assert main(["join", str(run.run_dir), "--region", "eu-south-9", "--label", "nowhere", "--wait", "60"]) == EXIT["refused"]
    refused = json.loads(capsys.readouterr().out)
    assert refused["event"] == "control_refused" and "no alive Ray node carries" in refused["why"], refused
    joined = _ask(capsys, "join", str(run.run_dir), "--region", new, "--wait", "120")
    assert joined["event"] == "region_joined" and joined["new"] is True and joined["label"] is None
    assert joined["alive"] == [*regions, new]
    summary = run.join(timeout_s=200)
    assert run.error is None, run.error
    first = joined["first_round"]

    # Its certificate is the run's CA's; its links are the emulator's default, measured before round `first`.
    assert (run.run_dir / "tls" / f"{new}.pem").is_file() and (run.run_dir / "tls" / f"{new}.key").stat().st_mode & 0o077 == 0
    assert [(e["region"], e["like"]) for e in events(run.run_dir, "links_added")] == [(new, None)]
    probed = [e for e in events(run.run_dir, "links_probed") if e.get("after") == "join"]
    assert len(probed) == 1 and probed[0]["round"] == first
    for region in regions:  # both ways: the others' links to it too
        assert new in {t["peer"] for t in probed[0]["probes"][region]}, probed[0]["probes"]
    assert {t["peer"] for t in probed[0]["probes"][new]} == set(regions)
    rejoined = events(run.run_dir, "region_rejoined")
    assert [(e["region"], e["after"]) for e in rejoined] == [(new, "join")] and rejoined[0]["donor"] in regions

    # Planned from round `first` over three regions: it sends and receives, and rounds.jsonl lists it.
    rounds = read_jsonl(run.run_dir / "rounds.jsonl")
    assert [r["round"] for r in rounds] == list(range(GROW_ROUNDS)) and 2 <= first < GROW_ROUNDS
    for rec in rounds:
        expect = regions if rec["round"] < first else [*regions, new]
        assert rec["alive"] == expect and rec["regions_reported"] == sorted(expect), rec["round"]
        assert any(new in link for link in rec["codecs"]) == (rec["round"] >= first)
    last = rounds[-1]["links"]
    assert last[f"{new}->{STAYS}"]["configured_bandwidth_mbps"] == 400.0 and last[f"{STAYS}->{new}"]["configured_rtt_ms"] == 4.0
    mine = [m for m in read_jsonl(run.run_dir / "metrics.jsonl") if m["region"] == new]
    seen = [(m["round"], sorted(m["codecs"]), m["peers_missing"], m["bytes_sent"]) for m in mine]
    assert [m["round"] for m in mine] == list(range(first, GROW_ROUNDS)) and all(m["bytes_sent"] > 0 for m in mine), seen

    # The rounds went on while its actor started: asked before round `asked`, the rounds from there to
    # `first` ran without it (its new process imports torch: it cannot answer the poll that made it).
    [starting] = [e for e in events(run.run_dir, "region_joining") if e["request"] == joined["request"]]
    asked = starting["asked_round"]
    assert joined["asked_round"] == asked < first and starting["new"] is True
    assert [rec["regions_reported"] for rec in rounds[asked:first]] == [sorted(regions)] * (first - asked)
    # After its join round it holds its peers' model: the round's sketches of all three agree.
    assert rounds[first]["regions_reported"] == sorted([*regions, new]) and rounds[first]["consensus_distance"] < 1e-4

    # The summary names it; DiLoCo over full: after its rounds it holds its peers' model.
    assert summary["joined"] == {new: {"round": first, "request": joined["request"], "new": True, "label": None}}
    assert set(summary["eval_per_region"]) == {*regions, new} and summary["consensus_distance"] < 1e-4
    assert new in summary["placement"] and not events(run.run_dir, "region_failed")
    assert not events(run.run_dir, "member_muted"), seen  # nobody's update was missed for long
