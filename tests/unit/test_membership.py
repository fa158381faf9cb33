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
    AwaitingNode,
    Membership,
    growth_refusal,
    parse_request,
    run_is_live,
    take_requests,
    withdraw_request,
    write_request,
)
from geofed.orchestrator.driver.rundir import Clock, lock_run_dir, read_jsonl, release_run_dir, write_config

NAMES = ["a", "b", "c"]
CFG = config_from_mapping({"task": {"kind": "mlp-digits"}, "regions": {"names": NAMES}})


class Regions:
    """The part of RegionHandles that Membership uses: cfg, names, alive, dead, leaving, retire."""

    def __init__(self) -> None:
        self.cfg = CFG
        self.names, self.alive, self.dead = list(NAMES), list(NAMES), {}
        self.leaving: dict[str, dict] = {}
        self.retired: list[str] = []
        self.actors = SimpleNamespace(handles={}, info={})

    def retire(self, region: str) -> None:
        self.alive.remove(region) if region in self.alive else self.dead.pop(region)
        self.leaving.pop(region, None)
        self.retired.append(region)

    def rejoin(self, region: str, address: str, info: dict) -> None:
        self.alive = [n for n in self.names if n in self.alive or n == region]
        del self.dead[region]


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

    membership.spawn = lambda region: placed.append(region) or ("handle", {"pid": 42})  # a region of the config
    membership.rejoin, membership.probe = rejoin, lambda alive, joiner: probed.append((alive, joiner))
    early = write_request(tmp_path, "join", "a")  # in the run: refused
    write_request(tmp_path, "leave", "b")
    back = write_request(tmp_path, "join", "b")  # after its leave, in the order written
    new = write_request(tmp_path, "join", "d")
    assert membership.poll(3) == ["b"]
    assert placed == ["b"] and rejoined == [("b", 3, 42)] and probed == [(NAMES, "b")] and regions.alive == NAMES
    assert regions.actors.handles == {"b": "handle"}
    by_id = {e["request"]: e for e in _events(tmp_path)}
    assert "is in the run" in by_id[early]["why"]
    assert by_id[back]["event"] == "region_joined" and by_id[back]["first_round"] == 3 and by_id[back]["alive"] == NAMES
    assert "cannot add regions under new names" in by_id[new]["why"]  # no grow: a driver without a coordinator
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


def _config(**sections) -> object:
    mapping: dict = {"task": {"kind": "mlp-digits"}, "regions": {"names": NAMES}}
    for key, value in sections.items():
        mapping.setdefault(key, {}).update(value)
    return config_from_mapping(mapping)


@pytest.mark.parametrize("region, label, sections, why", [
    ("Bad_Name", None, {}, "region name 'Bad_Name': region name 'Bad_Name' must match"),
    ("ca", None, {}, "region name 'ca': ca is reserved"),
    ("d", "-edge", {}, "label: '-edge' is not a node label value"),
    ("d", None, {"regions": {"workers": 2}}, "regions.workers > 1"),
    ("d", None, {"security": {"secure_aggregation": True}}, "security.secure_aggregation: .* fixed group"),
    ("d", None, {"sync": {"algorithm": "gossip"}, "compression": {"error_feedback": False}}, "sync.algorithm gossip: .*CHOCO"),
    ("d", None, {"privacy": {"dp": {"mode": "update", "noise_multiplier": 1.0}}}, "privacy.dp"),
    ("d", None, {"network": {"emulation": {"mode": "kernel"}}}, "network.emulation.mode kernel"),
    ("i", None, {"regions": {"names": list("abcdefgh")}}, "sized at start for 7 peers each; i would make 8"),
])
def test_a_run_that_cannot_grow_says_why(region, label, sections, why):
    assert growth_refusal(_config(**sections), {}, region, label) is not None
    assert re_search(why, growth_refusal(_config(**sections), {}, region, label))


def re_search(pattern: str, text: str | None) -> bool:
    import re

    return text is not None and re.search(pattern, text) is not None


def test_a_run_that_can_grow_takes_new_names_up_to_its_servers_size():
    assert growth_refusal(CFG, {}, "d", "zone-9") is None
    grown = {name: None for name in "defg"}  # 7 regions: 6 peers each
    assert growth_refusal(CFG, grown, "h", None) is None
    assert "would make 8" in growth_refusal(CFG, {**grown, "h": None}, "i", None)
    assert "must be unique" in growth_refusal(CFG, {"d": None}, "a", None)


def test_a_label_no_node_has_yet_is_looked_for_at_each_poll_and_refused_after_the_placement_deadline():
    """geofed join --label: the rounds do not wait for a node with the label; each poll looks again,
    the actor is made once a node carries it, and past regions.placement_timeout_s the join is refused."""
    seen, log = {"a": ["10.0.0.1"], "b": []}, []

    class Made:  # what cluster.start_region_actor hands back
        handle = "handle-d"

        def poll(self):
            return {"pid": 3}

        def end(self):
            log.append("ended")

    waiting = AwaitingNode("zone", "edge-9", timeout_s=30.0, seen=lambda key: log.append(key) or seen,
                           make=lambda: log.append("made") or Made())
    t0 = time.monotonic()
    assert waiting.poll() is None and waiting.handle is None and log == ["zone"]  # not there: no actor, no wait
    assert time.monotonic() - t0 < 0.5
    seen["edge-9"] = ["10.0.0.2"]
    assert waiting.poll() == {"pid": 3} and waiting.handle == "handle-d" and log == ["zone", "zone", "made"]
    waiting.end()
    assert log[-1] == "ended"
    late = AwaitingNode("zone", "edge-9", timeout_s=0.0, seen=lambda key: {"a": [], "b": []}, make=Made)
    with pytest.raises(ValueError, match=r"no alive Ray node carries zone=edge-9 after 0s .*values seen: a, b"):
        late.poll()


def _growing(tmp_path: Path) -> tuple[Membership, Regions, dict[str, list]]:
    """A Membership whose callbacks record what the driver's would do (run.py's _spawn, _grow, ...)."""
    from geofed.p2p.tls import make_pki

    make_pki(tmp_path / "tls", NAMES)
    membership, regions, _, _ = _membership(tmp_path)
    calls: dict[str, list] = {"spawn": [], "grow": [], "rejoin": [], "probe": [], "start": [], "connect": []}

    def spawn(region, cfg, label):
        calls["spawn"].append((region, list(cfg.regions.names), cfg.regions.label_of(region), label))
        return f"handle-{region}", {"pid": 7}

    def rejoin(region, r, info):
        calls["rejoin"].append((region, r))
        del regions.dead[region]
        regions.alive = [n for n in regions.names if n in regions.alive or n == region]

    membership.spawn, membership.rejoin = spawn, rejoin
    membership.probe = lambda alive, joiner: calls["probe"].append((alive, joiner))
    membership.grow = lambda region, label: calls["grow"].append((region, label))
    membership.start = lambda region: calls["start"].append(region) or f"127.0.0.1:{len(calls['start'])}"
    membership.connect = lambda: calls["connect"].append(True)
    return membership, regions, calls


def test_a_region_joins_under_a_new_name_and_a_resumed_run_rebuilds_it(tmp_path):
    from cryptography import x509
    from geofed.p2p.tls import load_tls

    membership, regions, calls = _growing(tmp_path)
    bad = write_request(tmp_path, "join", "Bad_Name")
    join = write_request(tmp_path, "join", "d", label="zone-9")
    again = write_request(tmp_path, "join", "d")
    membership.poll(4)
    by_id = {e["request"]: e for e in _events(tmp_path)}
    assert by_id[bad]["event"] == "control_refused" and "must match" in by_id[bad]["why"]
    assert "is in the run" in by_id[again]["why"]
    # Built from the run's config with d appended, placed on its label; then the coordinator and emulator grow.
    assert calls["spawn"] == [("d", [*NAMES, "d"], "zone-9", "zone-9")] and calls["grow"] == [("d", "zone-9")]
    assert regions.names == [*NAMES, "d"] and regions.alive == [*NAMES, "d"] and calls["rejoin"] == [("d", 4)]
    assert calls["probe"] == [([*NAMES, "d"], "d")]  # its links measured before round 4 carries its update
    joined = by_id[join]
    assert joined["event"] == "region_joined" and joined["new"] is True and joined["label"] == "zone-9"
    assert joined["first_round"] == 4 and joined["alive"] == [*NAMES, "d"]
    assert membership.summary_fields()["joined"] == {"d": {"round": 4, "request": join, "new": True, "label": "zone-9"}}
    # Its certificate comes from the run's own CA, whose key stays in RUN_DIR/tls.
    material = load_tls(tmp_path / "tls", "d")
    ca = x509.load_pem_x509_certificate(material.ca_pem)
    x509.load_pem_x509_certificate(material.cert_pem).verify_directly_issued_by(ca)
    assert sorted(p.name for p in (tmp_path / "tls").glob("*.key")) == ["a.key", "b.key", "c.key", "ca.key", "d.key"]

    state = membership.state_dict()
    assert state["grown"] == [["d", "zone-9"]]
    resumed, again_regions, again_calls = _growing(tmp_path / "resumed")
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as the driver checkpoint keeps it
    assert again_regions.names == [*NAMES, "d"] and again_regions.alive == [*NAMES, "d"]
    assert again_calls["grow"] == [("d", "zone-9")] and [c[0] for c in again_calls["spawn"]] == ["d"]
    assert again_calls["start"] == ["d"] and again_calls["connect"] == [True]
    assert again_regions.actors.handles == {"d": "handle-d"}
    assert resumed.joined == membership.joined
    # Its actor outlived a killed driver (run.orphan_timeout_s, driver/reattach.py): taken as it is, no new one.
    kept, kept_regions, kept_calls = _growing(tmp_path / "reattached")
    kept.load_state_dict(json.loads(json.dumps(state)),
                         live={"d": SimpleNamespace(handle="live-d", info={"pid": 7, "completed_round": 4})})
    assert kept_calls["spawn"] == [] and kept_regions.actors.handles == {"d": "live-d"}
    assert kept_regions.alive == [*NAMES, "d"] and kept_calls["start"] == ["d"] and kept_calls["connect"] == [True]
    assert not (tmp_path / "reattached" / "tls" / "d.key").exists()  # it keeps the certificate it holds


def test_a_new_name_whose_actor_cannot_be_placed_leaves_the_run_as_it_was(tmp_path):
    membership, regions, calls = _growing(tmp_path)

    def no_node(region, cfg, label):  # run._spawn's, past regions.placement_timeout_s with no node labelled
        return None, AwaitingNode(cfg.regions.label_key, label, timeout_s=0.0, seen=lambda key: {}, make=object)

    membership.spawn = no_node
    join = write_request(tmp_path, "join", "d", label="edge-9")
    membership.poll(2)
    refused = {e["request"]: e for e in _events(tmp_path)}[join]
    assert refused["event"] == "control_refused" and "its actor could not be placed: no alive Ray node" in refused["why"]
    assert regions.names == NAMES and calls["grow"] == [] and membership.grown == {}


def test_geofed_join_checks_a_new_name_and_its_label_before_asking(tmp_path, capsys):
    from geofed.orchestrator.driver.membership import request_from_args

    run_dir = _run_dir(tmp_path)

    def join(region: str, label: str | None = None) -> int:  # what `geofed join` hands over
        return request_from_args(SimpleNamespace(run_dir=str(run_dir), region=region, label=label, wait=0), "join")

    assert join("Bad_Name") == EXIT["bad_input"]
    assert "must match" in capsys.readouterr().err
    assert join("d", "no spaces") == EXIT["bad_input"]
    assert "--label" in capsys.readouterr().err
    assert join("d", "zone-9") == EXIT["not_running"]
    lock_run_dir(run_dir)
    try:
        assert join("d", "zone-9") == EXIT["done"]
    finally:
        release_run_dir(run_dir)
    [(_, request)] = take_requests(run_dir)
    assert (request.action, request.region, request.label) == ("join", "d", "zone-9")
    with pytest.raises(ValueError, match="only a join takes one"):
        parse_request("id", b'{"action": "leave", "region": "a", "label": "x"}')


class Starting:
    """What the driver's spawn hands back for a real actor (cluster.StartingActor): poll() says None
    until the test sets its node_info (or raises `fail`), end() is recorded."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.info: dict | None = None
        self.fail, self.ended = fail, False

    def poll(self) -> dict | None:
        if self.fail is not None:
            raise self.fail
        return self.info

    def end(self) -> None:
        self.ended = True


def _starting(membership: Membership, calls: dict[str, list]) -> dict[str, Starting]:
    starts: dict[str, Starting] = {}

    def spawn(region, cfg=None, label=None):
        calls["spawn"].append(region)
        starts[region] = Starting()
        return f"handle-{region}", starts[region]

    membership.spawn = spawn
    return starts


def test_the_rounds_go_on_while_a_joiners_actor_starts_and_it_joins_once_it_answers(tmp_path):
    membership, regions, calls = _growing(tmp_path)
    starts = _starting(membership, calls)
    write_request(tmp_path, "leave", "b")
    membership.poll(2)
    back = write_request(tmp_path, "join", "b")
    new = write_request(tmp_path, "join", "d")
    membership.poll(3)
    # Both actors are starting: the poll returned, nobody is added, planned, connected or probed for them yet.
    assert set(membership.joining) == {"b", "d"} and regions.actors.handles == {"b": "handle-b", "d": "handle-d"}
    assert regions.alive == ["a", "c"] and regions.names == NAMES and membership.out == {"b"}
    assert calls["rejoin"] == calls["grow"] == calls["probe"] == []
    by_id = {e["request"]: e for e in _events(tmp_path)}
    assert by_id[back]["event"] == by_id[new]["event"] == "region_joining" and by_id[new]["new"] is True
    assert by_id[back]["asked_round"] == 3 and by_id[back]["start_timeout_s"] == CFG.regions.start_timeout_s
    again = write_request(tmp_path, "join", "b")
    membership.poll(4)  # a round later, still starting
    assert "is joining already" in {e["request"]: e for e in _events(tmp_path)}[again]["why"]
    starts["b"].info = {"pid": 8}
    membership.poll(5)
    assert calls["rejoin"] == [("b", 5)] and calls["probe"] == [(NAMES, "b")] and regions.alive == NAMES
    assert set(membership.joining) == {"d"} and membership.out == set()
    joined = {e["request"]: e for e in _events(tmp_path)}[back]
    assert joined["event"] == "region_joined" and joined["first_round"] == 5 and joined["asked_round"] == 3
    assert joined["pid"] == 8 and joined["start_s"] >= 0
    starts["d"].info = {"pid": 9}
    membership.poll(6)
    # A new name is the run's only once it answered: then its links, the topology over it, its probes.
    assert calls["grow"] == [("d", None)] and regions.names == [*NAMES, "d"] and regions.alive == [*NAMES, "d"]
    assert calls["rejoin"][-1] == ("d", 6) and calls["probe"][-1] == ([*NAMES, "d"], "d")
    assert membership.summary_fields()["joined"] == {"b": {"round": 5, "request": back},
                                                     "d": {"round": 6, "request": new, "new": True, "label": None}}
    assert membership.state_dict()["grown"] == [["d", None]]


def test_two_new_names_come_in_in_the_order_asked_whichever_answers_first(tmp_path):
    """Each new name is built as the next region after those asked before it (its data shard and its
    place in the topology); one that answers before an earlier one waits for it, so the run's names
    grow in that order and each region's members extend its own list (Region.set_members)."""
    membership, regions, calls = _growing(tmp_path)
    starts = _starting(membership, calls)
    first, second = write_request(tmp_path, "join", "d"), write_request(tmp_path, "join", "e")
    membership.poll(1)
    assert membership.joining["d"].names == (*NAMES, "d") and membership.joining["e"].names == (*NAMES, "d", "e")
    starts["e"].info = {"pid": 7}  # the later one answers first: it waits
    membership.poll(2)
    assert regions.names == NAMES and set(membership.joining) == {"d", "e"} and not starts["e"].ended
    starts["d"].info = {"pid": 6}
    membership.poll(3)
    assert regions.names == [*NAMES, "d", "e"] and membership.joining == {}
    assert calls["grow"] == [("d", None), ("e", None)] and calls["spawn"] == ["d", "e"]
    by_id = {e["request"]: e for e in _events(tmp_path)}
    assert by_id[first]["first_round"] == by_id[second]["first_round"] == 3


def test_a_joiner_that_dies_starting_or_does_not_start_in_time_is_refused_and_ended(tmp_path):
    import dataclasses

    from geofed.orchestrator.driver.membership import requeue_unanswered

    membership, regions, calls = _growing(tmp_path)
    regions.cfg = dataclasses.replace(CFG, regions=dataclasses.replace(CFG.regions, start_timeout_s=0.2))
    starts = _starting(membership, calls)
    slow, dies, late = (write_request(tmp_path, "join", name) for name in ("d", "e", "f"))
    membership.poll(1)
    starts["e"].fail = RuntimeError("region e: its actor failed to start: worker died")
    time.sleep(0.3)
    first_f = starts["f"]
    first_f.info = {"pid": 5}  # in time, but built as the 6th region, after d and e: they gave up, so it is built again
    membership.poll(2)
    by_id = {e["request"]: e for e in _events(tmp_path)}
    assert by_id[slow]["event"] == "control_refused" and "did not start within 0.2s (regions.start_timeout_s)" in by_id[slow]["why"]
    assert by_id[dies]["event"] == "control_refused" and "its actor could not be placed: region e: its actor failed" in by_id[dies]["why"]
    assert first_f.ended and starts["f"] is not first_f and calls["spawn"].count("f") == 2
    assert membership.joining["f"].names == (*NAMES, "f") and regions.names == NAMES and calls["grow"] == []
    starts["f"].info = {"pid": 6}
    membership.poll(3)
    by_id = {e["request"]: e for e in _events(tmp_path)}
    assert by_id[late]["event"] == "region_joined" and by_id[late]["pid"] == 6
    assert starts["d"].ended and regions.names == [*NAMES, "f"] and set(regions.actors.handles) == {"f"}
    # Still starting when the run ends: answered, and its actor ended.
    last = write_request(tmp_path, "join", "g")
    membership.poll(4)
    membership.end_joins(4)
    assert starts["g"].ended and membership.joining == {} and "g" not in regions.actors.handles
    assert "the run ended after round 4 before its actor started" in {e["request"]: e for e in _events(tmp_path)}[last]["why"]
    # A driver killed while a joiner starts: its request was taken, region_joining is no answer, so a resume takes it again.
    killed = write_request(tmp_path, "join", "h")
    membership.poll(5)
    assert requeue_unanswered(tmp_path) == [killed]


def test_geofed_join_waits_for_the_real_join_and_says_the_actor_is_starting(tmp_path, capsys):
    run_dir = _run_dir(tmp_path)
    lock_run_dir(run_dir)
    try:
        membership, regions, journal, _ = _membership(run_dir)
        starts = _starting(membership, {"spawn": []})
        membership.rejoin = lambda region, r, info: regions.rejoin(region, "127.0.0.1:1", info)
        write_request(run_dir, "leave", "b")
        membership.poll(0)
        stop = threading.Event()

        def driver() -> None:  # rounds go on; the joiner's actor answers five polls after it was made
            r, made = 1, None
            while not stop.is_set():
                membership.poll(r)
                made = r if made is None and "b" in starts else made
                if made is not None and r >= made + 5:
                    starts["b"].info = {"pid": 11}
                r += 1
                time.sleep(0.05)

        thread = threading.Thread(target=driver, daemon=True)
        thread.start()
        try:
            assert main(["join", str(run_dir), "--region", "b", "--wait", "10"]) == EXIT["done"]
        finally:
            stop.set()
            thread.join(5)
        out, err = capsys.readouterr()
        joined = json.loads(out)
        assert joined["event"] == "region_joined" and joined["first_round"] > joined["asked_round"]
        assert "region b's actor is starting while the run goes on" in err and "regions.start_timeout_s" in err
        journal.close()
    finally:
        release_run_dir(run_dir)
