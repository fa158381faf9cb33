"""orchestrator/driver/recovery.py and resume.py without Ray: who resyncs from whom, the schedule a
resumed run plays, the signals that stop a run cleanly, and ending exactly the processes a
killed driver left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from geofed.orchestrator.driver.recovery import (
    DRIVER_FILE,
    Interrupted,
    StopSignals,
    plan_resync,
    process_tree,
    reap_previous,
    record_processes,
    schedule_after,
)
from geofed.p2p.wan.config import LinkSpec, ScheduleEvent
from support.reports import exchange

ORDER = ["a", "b", "c", "d"]


def _m(missing=(), heard=()):
    return exchange(missing=missing, heard=heard)


def test_no_resync_when_nobody_missed_anything():
    assert plan_resync({r: _m(heard=set(ORDER) - {r}) for r in ORDER}, ORDER) == []


def test_a_region_that_missed_takes_the_model_of_a_complete_one_it_heard_from():
    results = {"a": _m(heard="bcd"), "b": _m(missing="a", heard="cd"), "c": _m(heard="abd"), "d": _m(heard="abc")}
    (job,) = plan_resync(results, ORDER)
    assert job.region == "b" and job.donors == ("c", "d")  # not "a": the a -> b direction is down


def test_without_a_complete_region_the_one_that_missed_fewest_is_the_donor():
    # A region died mid-round: everyone missed it; then all take the first one's model.
    results = {"a": _m(missing="d", heard="bc"), "b": _m(missing="d", heard="ac"), "c": _m(missing="db", heard="a")}
    jobs = plan_resync(results, ORDER)
    assert [(j.region, j.donors) for j in jobs] == [("b", ("a",)), ("c", ("a",))]


def test_donors_fall_back_to_all_complete_when_none_was_heard():
    results = {"a": _m(heard="bc"), "b": _m(heard="ac"), "c": _m(missing="ab")}
    (job,) = plan_resync(results, ORDER[:3])
    assert job.region == "c" and job.donors == ("a", "b")


def test_schedule_after_drops_past_outages_keeps_link_changes_and_shifts_times():
    slow = LinkSpec(bandwidth_mbps=5.0)
    schedule = (
        ScheduleEvent(link="*", at_round=3, outage_s=30),                    # past outage: gone
        ScheduleEvent(link="a->b", at_round=4, set=slow, outage_s=5),         # past: change kept, outage gone
        ScheduleEvent(link="a->b", at_round=20, outage_s=5),                  # still to come
        ScheduleEvent(link="b->a", at_s=10.0, outage_s=2),                    # past
        ScheduleEvent(link="b->a", at_s=15.0, set=slow),                      # past change: at once
        ScheduleEvent(link="b->a", at_s=100.0, outage_s=2, outage_mode="reset"),  # shifted
    )
    got = schedule_after(schedule, next_round=10, elapsed_s=40.0)
    assert got == (
        ScheduleEvent(link="a->b", at_round=4, set=slow),
        ScheduleEvent(link="a->b", at_round=20, outage_s=5),
        ScheduleEvent(link="b->a", at_s=0.0, set=slow),
        ScheduleEvent(link="b->a", at_s=60.0, outage_s=2, outage_mode="reset"),
    )
    assert schedule_after(schedule, next_round=0, elapsed_s=0.0) == schedule


def test_first_signal_asks_for_a_clean_stop_the_second_stops_at_once():
    notified = []
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(notify=notified.append) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested and notified == ["SIGTERM"]
        assert Interrupted(stop.signum, 4).exit_code == 143
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    assert signal.getsignal(signal.SIGTERM) is before
    assert Interrupted(signal.SIGINT, -1).exit_code == 130


def test_stop_signals_are_inert_off_the_main_thread():
    seen = []

    def body():
        with StopSignals() as stop:
            seen.append(stop._old)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [{}]


TOKEN = "5f0c2b7d9e1a4c3b8d6f0a2e4c6b8d0f"


def _sleeper(env=None):
    # `ray::` and the run's marks: what a Ray worker of the dead driver's run shows in /proc
    # (tests/security/test_resume_reaping.py: processes without them are never touched).
    return subprocess.Popen(["ray::RegionActor", "-c", "import time; time.sleep(120)"],
                            executable=sys.executable, env={**os.environ, **(env or {})})


def test_reap_previous_ends_exactly_what_the_dead_driver_started(tmp_path):
    marks = {"GEOFED_RUN_DIR": str(tmp_path.resolve()), "GEOFED_RUN_TOKEN": TOKEN}
    child, bystander = _sleeper(marks), _sleeper(marks)
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        tree = {p[0]: p for p in process_tree(os.getpid())}
        assert child.pid in tree and bystander.pid in tree
        pid, start, name = tree[child.pid]
        bpid, bstart, bname = tree[bystander.pid]
        # The bystander is listed with another start time: a pid the system has since reused.
        (tmp_path / DRIVER_FILE).write_text(json.dumps(
            {"pid": dead.pid, "start": 1, "token": TOKEN, "processes": [[pid, start, name], [bpid, bstart + 1, bname]]}))
        reaped = reap_previous(tmp_path, grace_s=5.0)
        assert reaped == [{"pid": child.pid, "name": name}]
        assert child.wait(10) == -signal.SIGTERM
        assert bystander.poll() is None
    finally:
        for p in (child, bystander):
            p.kill()
            p.wait()


def test_reap_previous_refuses_while_that_driver_still_runs(tmp_path):
    record_processes(tmp_path, TOKEN)  # this very process plays the driver
    with pytest.raises(RuntimeError, match="is still running"):
        reap_previous(tmp_path)
    assert reap_previous(tmp_path / "elsewhere") == []
