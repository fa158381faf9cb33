"""Issue 9, point 2: a resume whose newest checkpoints are corrupt. The driver's torn newest
checkpoint is detected, reported (stderr and events.jsonl) and the previous one used; a region
whose own checkpoint of that round is corrupt takes the model from a peer that has it."""

from __future__ import annotations

import shutil

import pytest
from geofed.orchestrator.driver.resume import resume_config
from geofed.orchestrator.driver.rundir import new_run_dir, read_jsonl
from geofed.orchestrator.driver.run import Runner
from geofed.regions import checkpoint
from reliability_harness import REGIONS3, events, small_config

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


def _run(cfg, run_dir, *, resume=False):
    if not resume:
        new_run_dir(cfg, str(run_dir))  # writes config.yaml, which --resume reads
    runner = Runner(cfg, run_dir, show_progress=False, resume=resume)
    try:
        return runner.run()
    finally:
        runner.shutdown()


@pytest.fixture(scope="module")
def finished_run(ray_session, tmp_path_factory):
    """One 5-round run that both tests damage, each in a copy of its own: the second test's own
    run (2 rounds) cost as much as the first's (~35 s each on a loaded 2-core host)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    _run(small_config(rounds=5), run_dir)
    return run_dir


def test_resume_detects_corrupt_checkpoints_and_falls_back(finished_run, tmp_path, capsys):
    tmp_path = tmp_path / "run"
    shutil.copytree(finished_run, tmp_path)
    ckpts = tmp_path / "checkpoints"
    assert checkpoint.list_rounds(ckpts / "driver") == [2, 3, 4]  # keep_checkpoints: 3
    driver_newest = checkpoint.checkpoint_path(ckpts / "driver", 4)
    driver_newest.write_bytes(driver_newest.read_bytes()[:-64])  # torn tail
    region_r3 = checkpoint.checkpoint_path(ckpts / "eu-west-1", 3)
    damaged = bytearray(region_r3.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # one flipped bit's worth of rot
    region_r3.write_bytes(bytes(damaged))
    leftover = ckpts / "driver" / ".ckpt-00000005.pt.tmp-424242"
    leftover.write_bytes(b"half a checkpoint")

    cfg, _ = resume_config(tmp_path, ["run.rounds=7"], ["run.rounds"])
    summary = _run(cfg, tmp_path, resume=True)

    err = capsys.readouterr().err
    assert f"{driver_newest}: checksum mismatch" in err and "using the previous checkpoint" in err
    skipped = events(tmp_path, "checkpoint_skipped")
    assert {(e["who"], e["why"]) for e in skipped} == {
        ("driver", f"{driver_newest}: checksum mismatch (truncated or corrupt)"),
        ("eu-west-1", f"{region_r3}: checksum mismatch (truncated or corrupt)")}
    (resumed,) = events(tmp_path, "resumed")
    assert resumed["from_checkpoint"] == 3 and resumed["lost_rounds"] == [4]
    # The resume's set-up phases are its own seconds (logs_restore read minus the run's age).
    resumed_setup = events(tmp_path, "setup_done")[-1]
    assert resumed_setup["phases_s"] and all(v >= 0 for v in resumed_setup["phases_s"].values()), resumed_setup
    (from_peer,) = events(tmp_path, "region_state_from_peer")
    assert from_peer["region"] == "eu-west-1" and from_peer["own_round"] == 2
    assert from_peer["donor"] in set(REGIONS3) - {"eu-west-1"}

    rounds = read_jsonl(tmp_path / "rounds.jsonl")
    assert [r["round"] for r in rounds] == list(range(7))  # round 4 redone once, not twice
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert sorted((m["round"], m["region"]) for m in metrics) == sorted((i, g) for i in range(7) for g in REGIONS3)
    assert summary["rounds"] == 7 and not leftover.exists()
    # The regions trained on as one model after the fallback (the peer's state was used). Not
    # bit-equal: each region mixes its own update at full precision and the others' as fp16.
    assert summary["consensus_distance"] < 1e-4
    assert checkpoint.load_latest(ckpts / "driver")[0] == 6


def test_resume_without_a_usable_checkpoint_fails_clearly(finished_run, tmp_path):
    tmp_path = tmp_path / "run"
    shutil.copytree(finished_run, tmp_path)
    for path in (tmp_path / "checkpoints" / "driver").iterdir():
        path.write_bytes(b"garbage")
    cfg, _ = resume_config(tmp_path, [])
    with pytest.raises(Exception, match="no usable driver checkpoint to resume from .*not a geofed checkpoint"):
        _run(cfg, tmp_path, resume=True)
