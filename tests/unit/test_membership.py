"""The control channel to a live run (orchestrator/driver/membership.py, issue 41): requests written
atomically into RUN_DIR/control, taken once by renaming, malformed ones refused with a reason in
events.jsonl while the run goes on; the driver's leave rules; `geofed leave`'s exit codes. No Ray:
the region handle here keeps only what Membership reads and the retire it calls."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from types import SimpleNamespace

import pytest
from geofed.orchestrator.cli import main
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.journal import Journal
from geofed.orchestrator.driver.membership import (
    EXIT,
    Membership,
    parse_request,
    run_is_live,
    take_requests,
    withdraw_request,
    write_request,
)
from geofed.orchestrator.driver.rundir import Clock, lock_run_dir, read_jsonl, release_run_dir, write_config

NAMES = ["a", "b", "c"]


class Regions:
    """The part of RegionHandles that Membership uses: names, alive, dead, leaving, retire."""

    def __init__(self) -> None:
        self.names, self.alive, self.dead = list(NAMES), list(NAMES), {}
        self.leaving: dict[str, dict] = {}
        self.retired: list[str] = []
        self.actors = SimpleNamespace(handles={}, info={})

    def retire(self, region: str) -> None:
        self.alive.remove(region) if region in self.alive else self.dead.pop(region)
        self.leaving.pop(region, None)
        self.retired.append(region)


def _membership(run_dir: Path, busy=()) -> tuple[Membership, Regions, Journal, list[str]]:
    journal = Journal(Clock())
    journal.open(run_dir / "events.jsonl")
    regions, drained = Regions(), []
    return Membership(run_dir, regions, journal, busy=lambda: set(busy), drain=drained.append), regions, journal, drained


def _events(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "events.jsonl")


@pytest.mark.parametrize("raw, why", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "expected a JSON object, got list"),
    (b'{"action": "leave", "region": "a", "x": 1}', "unknown keys: x"),
    (b'{"action": "explode", "region": "a"}', "action: expected one of leave"),
    (b'{"action": "leave"}', "region: expected a region name, got None"),
    (b'{"action": "leave", "region": ""}', "region: expected a region name"),
    (b"\xff\xfe", "not JSON"),
    (b" " * 5000, "larger than 4096 bytes"),
])
def test_a_malformed_request_says_why(raw, why):
    with pytest.raises(ValueError, match=why):
        parse_request("id", raw)


def test_a_request_is_written_whole_and_taken_once(tmp_path):
    rid = write_request(tmp_path, "leave", "b")
    control = tmp_path / "control"
    assert [p.name for p in control.iterdir()] == [f"{rid}.json"]  # no temporary file left beside it
    (control / ".half.tmp").write_text('{"action": "le')  # a writer's temporary file is never read
    got = take_requests(tmp_path)
    assert [(i, r.action, r.region) for i, r in got] == [(rid, "leave", "b")]
    assert (control / f"{rid}.json.taken").is_file() and not (control / f"{rid}.json").exists()
    assert take_requests(tmp_path) == []  # taken once
    rid2 = write_request(tmp_path, "leave", "c")
    assert withdraw_request(tmp_path, rid2) and not withdraw_request(tmp_path, rid2)
    assert take_requests(tmp_path) == []


def test_the_driver_refuses_malformed_and_impossible_requests_and_goes_on(tmp_path):
    membership, regions, _, drained = _membership(tmp_path)
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "20260101-000000-1-bad.json").write_bytes(b"garbage")
    (tmp_path / "control" / "../control/Weird Name.json").write_text('{"action": "leave", "region": "a"}')
    unknown = write_request(tmp_path, "leave", "zz")
    leave_b = write_request(tmp_path, "leave", "b")
    again_b = write_request(tmp_path, "leave", "b")
    assert membership.poll(3) == ["b"]
    assert regions.alive == ["a", "c"] and regions.retired == ["b"] and drained == ["b"]
    by_id = {e["request"]: e for e in _events(tmp_path)}
    assert "not JSON" in by_id["20260101-000000-1-bad"]["why"]
    assert "not a request id" in by_id["Weird Name"]["why"] and regions.alive != ["c"]  # never acted on
    assert by_id[unknown]["event"] == "control_refused" and "unknown region 'zz'" in by_id[unknown]["why"]
    assert by_id[again_b]["event"] == "control_refused" and "already left" in by_id[again_b]["why"]
    left = by_id[leave_b]
    assert left["event"] == "region_left" and left["last_round"] == 2 and left["alive"] == ["a", "c"]
    assert membership.summary_fields() == {"left": {"b": {"round": 2, "why": "request", "request": leave_b}}, "joined": {}}
    write_request(tmp_path, "leave", "c")
    last = write_request(tmp_path, "leave", "a")
    assert membership.poll(4) == ["c"]
    assert regions.alive == ["a"]
    assert "the last region" in {e["request"]: e for e in _events(tmp_path)}[last]["why"]


def test_a_leave_waits_for_the_regions_round_in_flight(tmp_path):
    busy = {"b"}
    membership, regions, _, _ = _membership(tmp_path, busy=busy)
    membership.busy = lambda: busy
    write_request(tmp_path, "leave", "b")
    assert membership.poll(1) == [] and regions.alive == NAMES
    busy.clear()
    assert membership.poll(2) == ["b"] and regions.alive == ["a", "c"]


def test_a_resumed_run_keeps_who_left_out(tmp_path):
    membership, _, _, _ = _membership(tmp_path)
    write_request(tmp_path, "leave", "c")
    membership.poll(2)
    resumed, regions, _, _ = _membership(tmp_path)
    resumed.load_state_dict(membership.state_dict())
    assert regions.alive == ["a", "b"] and resumed.left == membership.left


def _run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, config_from_mapping({"task": {"kind": "mlp-digits"}, "regions": {"names": NAMES}}))
    return run_dir


def test_geofed_leave_exit_codes_without_a_driver(tmp_path, capsys):
    assert main(["leave", str(tmp_path), "a"]) == EXIT["bad_input"]  # not a run directory
    run_dir = _run_dir(tmp_path)
    assert main(["leave", str(run_dir), "nope"]) == EXIT["bad_input"]
    assert "unknown region 'nope'" in capsys.readouterr().err
    assert not run_is_live(run_dir)
    assert main(["leave", str(run_dir), "b"]) == EXIT["not_running"]
    assert "no driver runs" in capsys.readouterr().err
    assert not list((run_dir / "control").glob("*.json")) if (run_dir / "control").exists() else True


def test_geofed_leave_waits_for_the_drivers_answer(tmp_path, capsys):
    run_dir = _run_dir(tmp_path)
    lock_run_dir(run_dir)  # the driver's lock: the run is live
    try:
        assert run_is_live(run_dir)
        membership, regions, journal, _ = _membership(run_dir)
        stop = threading.Event()

        def driver() -> None:  # a driver's rounds: a poll between each
            r = 0
            while not stop.is_set():
                membership.poll(r)
                r += 1
                time.sleep(0.05)

        thread = threading.Thread(target=driver, daemon=True)
        thread.start()
        try:
            t0 = time.monotonic()
            assert main(["leave", str(run_dir), "b", "--wait", "10"]) == EXIT["done"]
            answer = json.loads(capsys.readouterr().out)
            assert answer["event"] == "region_left" and answer["region"] == "b"
            assert main(["leave", str(run_dir), "b", "--wait", "10"]) == EXIT["refused"]
            assert "already left" in json.loads(capsys.readouterr().out)["why"]
            assert time.monotonic() - t0 < 5
        finally:
            stop.set()
            thread.join(5)
        # A driver that takes no request: the wait ends and the request is withdrawn.
        assert main(["leave", str(run_dir), "c", "--wait", "0.3"]) == EXIT["timed_out"]
        assert "withdrawn" in capsys.readouterr().err
        assert not list((run_dir / "control").glob("*.json"))
        assert regions.alive == ["a", "c"]
        journal.close()
    finally:
        release_run_dir(run_dir)
    assert not run_is_live(run_dir)


class Report:
    def __init__(self, **extra) -> None:
        self.extra = extra


def test_a_spot_notice_in_a_report_or_a_heartbeat_leaves_after_the_round(tmp_path):
    membership, regions, _, drained = _membership(tmp_path)
    membership.note_reports({"a": Report(), "b": Report(leaving=True, grace_left_s=12.5)})
    assert membership.poll(4) == ["b"] and regions.alive == ["a", "c"] and drained == ["b"]
    left = [e for e in _events(tmp_path) if e["event"] == "region_left"]
    assert left == [dict(left[0], region="b", why="sigterm", request=None, last_round=3, grace_left_s=12.5)]
    # A heartbeat's notice for a region that died when its grace ran out (now in `dead`): retired, not revived.
    regions.alive.remove("c")
    regions.dead["c"] = "actor died during run_round"
    regions.leaving["c"] = {"leaving": True}
    regions.leaving["a"] = {"leaving": True}  # the last region: kept, said once
    assert membership.poll(5) == ["c"] and regions.dead == {} and regions.alive == ["a"]
    assert membership.poll(6) == [] and regions.alive == ["a"] and membership.kept == {"a"}
    assert membership.summary_fields()["left"]["c"]["why"] == "sigterm"


def test_a_region_that_left_joins_again_through_the_rejoin_path(tmp_path):
    membership, regions, _, _ = _membership(tmp_path)
    placed, rejoined, probed = [], [], []

    def rejoin(region, r, info):  # faults.Faults.join: back in alive, at its place
        rejoined.append((region, r, info["pid"]))
        del regions.dead[region]
        regions.alive = [n for n in NAMES if n in regions.alive or n == region]

    membership.spawn = lambda region: placed.append(region) or ("handle", {"pid": 42})
    membership.rejoin, membership.probe = rejoin, probed.append
    early = write_request(tmp_path, "join", "a")  # in the run: refused
    write_request(tmp_path, "leave", "b")
    back = write_request(tmp_path, "join", "b")  # after its leave, in the order written
    new = write_request(tmp_path, "join", "d")
    assert membership.poll(3) == ["b"]
    assert placed == ["b"] and rejoined == [("b", 3, 42)] and probed == [NAMES] and regions.alive == NAMES
    assert regions.actors.handles == {"b": "handle"}
    by_id = {e["request"]: e for e in _events(tmp_path)}
    assert "is in the run" in by_id[early]["why"]
    assert by_id[back]["event"] == "region_joined" and by_id[back]["first_round"] == 3 and by_id[back]["alive"] == NAMES
    assert "not supported yet" in by_id[new]["why"]
    assert membership.summary_fields()["joined"] == {"b": {"round": 3, "request": back}}
    assert membership.out == set()
    # Gone again: it can leave again (it is no longer out).
    write_request(tmp_path, "leave", "b")
    assert membership.poll(5) == ["b"]


def test_joins_are_refused_where_no_actor_can_be_placed(tmp_path):
    membership, _, _, _ = _membership(tmp_path)
    write_request(tmp_path, "leave", "b")
    join = write_request(tmp_path, "join", "b")
    membership.poll(1)
    assert "cannot place new region actors" in {e["request"]: e for e in _events(tmp_path)}[join]["why"]


def test_a_resumed_driver_takes_again_what_its_killed_predecessor_took_but_never_answered(tmp_path):
    from geofed.orchestrator.driver.membership import requeue_unanswered

    answered = write_request(tmp_path, "leave", "b")
    lost = write_request(tmp_path, "join", "c")
    assert [rid for rid, _ in take_requests(tmp_path)] == [answered, lost]  # the driver that is then killed
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "region_left", "region": "b", "request": answered}) + "\n")
    assert requeue_unanswered(tmp_path) == [lost]
    (taken,) = take_requests(tmp_path)
    assert taken[0] == lost and taken[1].action == "join" and taken[1].region == "c"
    assert requeue_unanswered(tmp_path) == [lost]  # until it is answered
