"""Issue 19, trap 3 (output): without a terminal nothing was printed per round, and the summary's
"wall time 4.4 s" followed a 39 s wait without saying that set-up was left out."""

from __future__ import annotations

import io

from geofed.orchestrator.driver.progress import RunProgress, print_summary, round_line
from rich.console import Console


def test_without_a_terminal_one_line_per_round():
    buf = io.StringIO()
    p = RunProgress(3, enabled=True, console=Console(file=buf, force_terminal=False, width=80))
    assert p.plain
    for r in range(3):
        p.update(round_=r, loss=2.0 - r, H=20, mb_sent=1.5 * (r + 1), codec="int8", utilization=0.8, elapsed_s=r + 1.0)
    p.stop()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("round 0 (1/3 done) loss 2.0000 H 20 codec int8 sent 1.50 MB util 0.80 elapsed 1.0s eta ")
    assert lines[2].startswith("round 2 (3/3 done) loss 0.0000") and lines[2].endswith("eta 0.0s")


def test_quiet_prints_nothing():
    buf = io.StringIO()
    p = RunProgress(2, enabled=False, console=Console(file=buf, force_terminal=False))
    p.update(round_=0, loss=1.0, H=5, mb_sent=0.1)
    p.stop()
    assert buf.getvalue() == ""


def test_round_line_long_runs():
    line = round_line(round_=9, total=100, loss=None, H=400, codec="int8,topk", mb_sent=123.4, utilization=None,
                      elapsed_s=125, eta_s=4000, note="down: eu-west-1")
    assert line == "round 9 (10/100 done) loss - H 400 codec int8,topk sent 123.4 MB util - elapsed 2m05s eta 1h06m down: eu-west-1"


def test_summary_shows_set_up_and_training_apart(capsys):
    summary = {"rounds": 3, "wall_s": 4.4, "setup_s": 30.0, "startup": {"process_to_round0_s": 39.0},
               "eval": {"metric": "accuracy", "value": 0.9}, "bytes_sent": 1e6, "compute_utilization": 0.8,
               "faults": {"region_restarts": 0, "peers_left_out": 0}, "refusals": {"total": 0}}
    print_summary(summary, "runs/x")
    out = capsys.readouterr().out
    assert "set-up time (start to first round)" in out and "39.0 s" in out
    assert "training time (round 0 to end)" in out and "4.4 s" in out
    assert "wall time" not in out


def test_summary_shows_the_regions_eval_range_when_their_models_differ(capsys):
    """The eval shown is one region's (diloco): regions that drifted apart show their range."""
    base = {"rounds": 3, "wall_s": 4.4, "eval": {"metric": "accuracy", "value": 0.8889}, "bytes_sent": 1e6,
            "compute_utilization": 0.8, "faults": {"region_restarts": 0, "peers_left_out": 2}, "refusals": {"total": 0}}
    apart = {"a": {"value": 0.8889}, "b": {"value": 0.9178}, "c": {"value": 0.8778}}
    print_summary({**base, "eval_per_region": apart}, "runs/x")
    assert "0.8889 (regions 0.8778-0.9178)" in capsys.readouterr().out
    one = {r: {"value": 0.8889} for r in "abc"}
    print_summary({**base, "eval_per_region": one}, "runs/x")
    assert "(regions" not in capsys.readouterr().out


def test_eta_counts_run_max_steps_when_that_ends_the_run():
    """Issue 37, Why 8: a run of rounds: 1000 that max_steps: 100 ends after 10 rounds of H 10 read
    eta 2h46m after its first 10 s round (it counted run.rounds; the real run: 7 minutes, eta 6h17m).
    Before the fix RunProgress took no max_steps (TypeError), and its ETA counted the 999 rounds left."""
    now = [0.0]
    buf = io.StringIO()
    p = RunProgress(1000, enabled=True, max_steps=100, console=Console(file=buf, force_terminal=False, width=200),
                    clock=lambda: now[0])
    for r in range(3):
        now[0] += 10.0
        p.update(round_=r, loss=1.0, H=10, steps_done=10 * (r + 1), mb_sent=0.1, elapsed_s=now[0])
    lines = buf.getvalue().splitlines()
    assert lines[0].endswith("eta 1m30s") and lines[2].endswith("eta 1m10s")  # 10 s per 10 steps, 90 then 70 left
    # rounds end it first when they are fewer: the smaller of the two
    q = RunProgress(5, enabled=True, max_steps=10_000, console=Console(file=io.StringIO(), force_terminal=False),
                    clock=lambda: now[0])
    now[0] += 10.0
    q.update(round_=0, loss=1.0, H=10, steps_done=10, mb_sent=0.1)
    assert q.eta_s == 40.0
    # a resume: its pace is this process's steps, from the checkpoint's count on
    r = RunProgress(1000, enabled=True, start=5, max_steps=100, start_steps=50,
                    console=Console(file=io.StringIO(), force_terminal=False), clock=lambda: now[0])
    now[0] += 5.0
    r.update(round_=5, loss=1.0, H=10, steps_done=60, mb_sent=0.1)
    assert r.eta_s == 20.0
