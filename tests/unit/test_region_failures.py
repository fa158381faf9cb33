"""Issue 39, item 4: a region killed by Ray is named, with why, how often and the rounds it missed
(summary.json faults.by_region, the end-of-run table, the report), and a run that ends with fewer
live regions than it started with says so in its last line.

The classifier is fed the exceptions Ray 2.60 raises, built from Ray's own types and the text its
raylet and GCS write (read off a real memory-monitor kill and a real SIGKILL on this machine),
not mocks.
"""

from __future__ import annotations

import json

import pytest
import ray
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver import failures
from geofed.orchestrator.driver.progress import end_line, print_summary
from geofed.orchestrator.driver.rundir import JsonlLog
from geofed.orchestrator.driver.summary import build_summary, round_ranges
from ray.core.generated import common_pb2, gcs_pb2

REGIONS = ["us-east-1", "eu-west-1", "ap-south-1"]

# What Ray's memory monitor wrote when it killed an actor here (RAY_memory_usage_threshold=0.3):
# the OutOfMemoryError's message, and the worker's exit_detail in the GCS worker table.
MONITOR = ("1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, "
           "ID: 11aa9a246c3c63c13a5b588dafeef1bb481db2372074f9a5667e4a6d) was 7.20GB used / 23.54GB limit (0.305779)\n"
           "OOM kill reason: Memory usage 7671693312B exceeded threshold of 7582858752B (30.0% of 25276194816B limit)\n"
           "Ray killed 1 worker(s) based on the killing policy")
# A SIGKILLed worker's exit_detail: it names the OOM killer as one possible cause, which is no OOM.
SIGKILLED = ("Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: "
             "(1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force was "
             "called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.")
# What the pending call of a restartable actor raises after either kill.
RESTARTED = "The actor is temporarily unavailable: IOError: The actor was restarted"


def _unavailable() -> ray.exceptions.ActorUnavailableError:
    return ray.exceptions.ActorUnavailableError(RESTARTED, b"\x01" * 16)


def test_an_oom_kill_is_told_from_a_sigkill():
    # An actor past its restarts: Ray raises OutOfMemoryError, which is no RayActorError.
    oom = ray.exceptions.OutOfMemoryError(MONITOR)
    assert not isinstance(oom, ray.exceptions.RayActorError) and isinstance(oom, failures.ACTOR_DEATHS)
    death = failures.death_cause(oom)
    assert death.cause == failures.OOM and "running low on memory" in death.detail and "7.20GB used" in death.detail
    # An actor Ray restarts: the same ActorUnavailableError for both; the worker table tells them apart.
    killed_by_monitor = gcs_pb2.WorkerTableData(pid=4242, is_alive=False, exit_type=common_pb2.NODE_OUT_OF_MEMORY,
                                                exit_detail=MONITOR)
    sigkilled = gcs_pb2.WorkerTableData(pid=4243, is_alive=False, exit_type=common_pb2.SYSTEM_ERROR,
                                        exit_detail=SIGKILLED)
    assert failures.death_cause(_unavailable(), failures.exit_of_row(killed_by_monitor)).cause == failures.OOM
    death = failures.death_cause(_unavailable(), failures.exit_of_row(sigkilled))
    assert death.cause == failures.PROCESS_DIED and death.detail.startswith("Worker unexpectedly exits")
    assert failures.death_cause(_unavailable()).cause == failures.PROCESS_DIED  # no row: Ray's text alone
    assert failures.exit_of_row(gcs_pb2.WorkerTableData(pid=1, is_alive=True)) is None


def test_a_dead_node_a_preemption_and_the_driver_own_reasons():
    actor = {"actor_id": b"\x02" * 16, "class_name": "RegionActor", "pid": 4242}
    node = common_pb2.ActorDiedErrorContext(
        **actor, error_message="The actor died because its node has died. Node Id: 3c1f",
        reason=common_pb2.ActorDiedErrorContext.NODE_DIED)
    assert failures.death_cause(ray.exceptions.ActorDiedError(cause=node)).cause == failures.NODE_DIED
    drained = common_pb2.ActorDiedErrorContext(
        **actor, error_message="The actor died because its node has died.",
        node_death_info=common_pb2.NodeDeathInfo(reason=common_pb2.NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED))
    assert failures.death_cause(ray.exceptions.ActorDiedError(cause=drained)).cause == failures.PREEMPTED
    worker = common_pb2.ActorDiedErrorContext(
        **actor, error_message=f"The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
                      f"Worker exit detail: {SIGKILLED}")
    assert failures.death_cause(ray.exceptions.ActorDiedError(cause=worker)).cause == failures.PROCESS_DIED
    assert failures.cause_of_text("round 4 did not finish within 612s") == failures.TIMEOUT
    assert failures.cause_of_text("stalled for 40s; killed for Ray to restart") == failures.STALLED
    # a region of several workers whose group was lost with no process dead (regions/workers.py's GroupLost)
    lost = "region a worker 0 of 2 lost its region's process group during the gradient all_reduce: timed out"
    assert failures.cause_of_text(lost) == failures.GROUP_LOST
    assert failures.cause_of_text("region a worker 1 of 2 holds no process group: its region's group was lost") \
        == failures.GROUP_LOST
    assert failures.worker_exit(None) is None


def _write_run(tmp_path, alive_of: dict[int, list[str]], events: list[dict], names: list[str], faults: dict) -> dict:
    """A run directory whose rounds had `alive_of` alive (each alive region's metrics, a quiet round's)
    and `events` after `started`; its summary as build_summary makes it for `names`."""
    metrics, rounds, log = (JsonlLog(tmp_path / f"{n}.jsonl") for n in ("metrics", "rounds", "events"))
    for r, alive in alive_of.items():
        for region in alive:
            metrics.write({"round": r, "region": region, "train_loss": 1.0, "compute_s": 0.1, "wall_s": 0.2,
                           "bytes_sent": 10, "bytes_received": 10, "transfers": []})
        rounds.write({"round": r, "t_start": r, "t_end": r + 1, "H": 5, "alive": alive, "regions_reported": alive,
                      "links": {}})
    for e in [{"t": 0.0, "round": 0, "event": "started", "regions": {}}, *events]:
        log.write(e)
    for f in (metrics, rounds, log):
        f.close()
    cfg = config_from_mapping({"regions": {"names": names}, "task": {"kind": "mlp-digits"},
                               "network": {"emulation": {"mode": "none"}}})
    return build_summary(cfg, tmp_path, eval_avg=None, eval_per_region=None, consensus=None, transport_stats={},
                         faults=faults, placement={}, emulator=None, wall_s=6.0)


def _run_dir(tmp_path, *, last_back: bool):
    """Six rounds: eu-west-1 OOM-killed in round 2, back (restarted) in round 4; ap-south-1 stalls in
    round 4, is killed in round 5 and (last_back False) never comes back."""
    alive_of = {0: REGIONS, 1: REGIONS, 2: ["us-east-1", "ap-south-1"], 3: ["us-east-1", "ap-south-1"],
                4: ["us-east-1", "eu-west-1"], 5: ["us-east-1", "eu-west-1"]}
    events: list[dict] = []
    events.append({"t": 2.5, "round": 2, "event": "region_failed", "region": "eu-west-1", "cause": "OOM",
                   "why": "actor died during round 2: OOM"})
    events.append({"t": 4.0, "round": 4, "event": "region_rejoined", "region": "eu-west-1", "after": "restart"})
    events.append({"t": 4.5, "round": 4, "event": "region_stalled", "region": "ap-south-1"})
    events.append({"t": 5.5, "round": 5, "event": "region_failed", "region": "ap-south-1", "cause": "stalled",
                   "why": "stalled for 30s; killed for Ray to restart"})
    if not last_back:  # the final checkpoint, after round 5 was logged: us-east-1 dies there too
        events.append({"t": 6.5, "round": 6, "event": "region_failed", "region": "us-east-1", "cause": "process died"})
    faults = {"region_restarts": 1, "region_failures": 2, "peers_left_out": 0, "late_dropped": 0, "region_stalls": 1}
    return _write_run(tmp_path, alive_of, events, REGIONS, faults)


def test_the_summary_names_each_region_its_causes_and_the_rounds_it_missed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the table's lines unwrapped
    summary = _run_dir(tmp_path, last_back=True)
    by_region = summary["faults"]["by_region"]
    assert list(by_region) == ["eu-west-1", "ap-south-1"]  # regions.names order; us-east-1 had nothing
    assert by_region["eu-west-1"] == {"failures": 1, "restarts": 1, "stalls": 0, "rounds_out": [[2, 3]],
                                      "causes": ["OOM"], "failed_in": [2], "stalled_in": []}
    assert by_region["ap-south-1"] == {"failures": 1, "restarts": 0, "stalls": 1, "rounds_out": [[4, 5]],
                                       "causes": ["stalled"], "failed_in": [5], "stalled_in": [4]}
    assert summary["faults"]["region_rounds_out"] == sum(r[1] - r[0] + 1 for f in by_region.values()
                                                         for r in f["rounds_out"])
    assert summary["faults"]["region_failures"] == 2  # the aggregate keys stay
    assert summary["live_regions"] == {"started": REGIONS, "ended": ["us-east-1", "eu-west-1"]}
    json.dumps(summary)  # summary.json takes it as is
    assert end_line(summary) == "ended with 2 of 3 regions: ap-south-1 failed in round 5 (stalled) and did not come back"

    print_summary(summary, str(tmp_path))
    out = capsys.readouterr().out
    assert "region failures" in out
    assert "eu-west-1 x1 (OOM), restarted x1, rounds 2-3 missed" in out
    assert "ap-south-1 x1 (stalled), stalled x1, rounds 4-5 missed, out at the end" in out


def test_a_failure_after_the_last_round_and_a_leave_are_in_the_last_line(tmp_path):
    summary = _run_dir(tmp_path, last_back=False)
    assert summary["live_regions"]["ended"] == ["eu-west-1"]
    summary["left"] = {}
    line = end_line(summary)
    assert line.startswith("ended with 1 of 3 regions: ")
    assert "us-east-1 failed in round 6 (process died) and did not come back" in line
    # A region that left (geofed leave) is named as such, not as a failure.
    summary["left"] = {"ap-south-1": {"round": 3, "why": "request", "request": "r1"}}
    assert "ap-south-1 left after round 3" in end_line(summary)
    summary["live_regions"]["ended"] = REGIONS
    assert end_line(summary) is None  # every region there at the end: no line


def test_the_report_names_the_failed_regions(tmp_path):
    from geofed.orchestrator.report.html import _end_warning, _faults_table, _region_failures
    from geofed.orchestrator.report.load import load_run

    summary = _run_dir(tmp_path, last_back=True)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    run = load_run(tmp_path)
    section = _region_failures(run)
    assert "<td>eu-west-1</td><td class=n>1</td><td>OOM</td><td class=n>1</td><td class=n>0</td><td>2-3</td><td>yes</td>" \
        in section, section
    assert "<td>ap-south-1</td>" in section and "<td>4-5</td><td>no</td>" in section
    assert "by region" not in _faults_table(run)  # the dict is the table above, not a row of JSON
    assert "Ended with 2 of 3 regions: ap-south-1 failed in round 5" in _end_warning(run)


@pytest.mark.parametrize("rounds, ranges", [([], []), ([3], [[3, 3]]), ([4, 2, 3, 7, 9, 8], [[2, 4], [7, 9]])])
def test_round_ranges(rounds, ranges):
    assert round_ranges(rounds) == ranges


def test_an_actor_killed_for_memory_while_starting_fails_set_up_in_one_line_that_says_so():
    """Set-up's wait for the region actors (cluster.wait_ready) raised Ray's OutOfMemoryError raw:
    several lines of Ray's, no region named. Now: one PlacementError naming the region and the cause."""
    from geofed.orchestrator.driver.cluster import PlacementError, start_failure

    err = start_failure("eu-west-1", ray.exceptions.OutOfMemoryError(MONITOR))
    assert isinstance(err, PlacementError)
    text = str(err)
    assert text.startswith("region eu-west-1: its actor ran out of memory while starting")
    assert "1 worker(s) were killed due to the node running low on memory" in text and "\n" not in text
    assert "bytes per parameter" in text and "docs/bench-memory.md" in text
    other = str(start_failure("eu-west-1", ray.exceptions.RayActorError()))
    assert other.startswith("region eu-west-1: its actor failed to start") and "memory" not in other


def test_a_region_joined_under_a_new_name_counts_its_rounds_out_from_its_first_round(tmp_path):
    """summary's rounds out knew only regions.names: a region that joined under a new name (geofed
    join) and then failed was out of no round. It counts from its join round, not before."""
    two = ["us-east-1", "eu-west-1"]
    alive_of = {0: two, 1: two, 2: [*two, "sa-east-1"], 3: [*two, "sa-east-1"], 4: two, 5: two}
    events = [{"t": 2.0, "round": 2, "event": "region_joined", "region": "sa-east-1", "first_round": 2,
               "new": True, "label": None, "alive": [*two, "sa-east-1"]},
              {"t": 4.5, "round": 4, "event": "region_failed", "region": "sa-east-1", "cause": "process died"}]
    faults = {"region_restarts": 0, "region_failures": 1, "peers_left_out": 0, "late_dropped": 0, "region_stalls": 0}
    summary = _write_run(tmp_path, alive_of, events, two, faults)
    assert summary["faults"]["region_rounds_out"] == 2
    assert summary["faults"]["by_region"]["sa-east-1"]["rounds_out"] == [[4, 5]]
