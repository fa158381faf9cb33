"""Issue 15, finding 14: checkpoints were world-readable (0644 in 0755 folders), events.jsonl
(every region's address and pid) too. Now everything a run writes in its run directory is its
owner's alone: folders 0700, files 0600, whatever the umask, kept across atomic rewrites, and
tightened when an older run directory is resumed. ca.key stays (0600): a resume renews
certificates from the run's CA (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.resume import resume_config
from geofed.orchestrator.driver.rundir import JsonlLog, new_run_dir, truncate_jsonl, write_json
from geofed.orchestrator.driver.run import Runner
from geofed.regions import checkpoint

BASE = {"run": {"name": "modes", "rounds": 2, "report": False, "checkpoint_every": 1},
        "task": {"kind": "mlp-digits", "hidden": 8},
        "regions": {"names": ["us-east-1", "eu-west-1"], "num_cpus": 0.5},
        "network": {"emulation": {"mode": "none"}, "max_message_mb": 4},
        "sync": {"deadline": {"initial_s": 3.0, "min_s": 0.5, "max_s": 4.0}}}


def _cfg():
    return config_from_mapping(json.loads(json.dumps(BASE)))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _open_to_others(root: Path) -> list[str]:
    """Every path under root (root included) that group or others may read, write or enter."""
    bad = [f"{root} {_mode(root):o}"] if _mode(root) & 0o077 else []
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            if _mode(p) & 0o077:
                bad.append(f"{p.relative_to(root)} {_mode(p):o}")
    return bad


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)  # the usual default: what was written 0644/0755 before
    yield
    os.umask(old)


def test_run_dir_config_logs_checkpoints_and_summary_are_private(tmp_path, loose_umask):
    run_dir = new_run_dir(_cfg(), str(tmp_path / "run"))
    log = JsonlLog(run_dir / "events.jsonl")
    log.write({"event": "started", "regions": {"us-east-1": {"pid": 1, "grpc_address": "127.0.0.1:1"}}})
    log.close()
    # A region writes its checkpoints into folders that do not exist yet (on its own node, the
    # whole run directory path may be new).
    checkpoint.save_atomic(checkpoint.checkpoint_path(run_dir / "checkpoints" / "us-east-1", 0), {"w": torch.ones(2)})
    checkpoint.save_atomic(checkpoint.checkpoint_path(tmp_path / "node2" / "run" / "checkpoints" / "eu-west-1", 0),
                           {"w": torch.ones(2)})
    write_json(run_dir / "summary.json", {"rounds": 1})
    truncate_jsonl(run_dir / "events.jsonl", lambda rec: True)  # an atomic rewrite keeps the mode
    assert _open_to_others(run_dir) == []
    assert _open_to_others(tmp_path / "node2") == []
    assert {p.name for p in run_dir.iterdir()} >= {"config.yaml", "config.record.json", "events.jsonl",
                                                   "summary.json", "checkpoints"}


def test_resuming_an_older_run_directory_tightens_it(tmp_path, loose_umask):
    run_dir = new_run_dir(_cfg(), str(tmp_path / "run"))
    os.chmod(run_dir, 0o755)
    (run_dir / "events.jsonl").write_text("")
    os.chmod(run_dir / "events.jsonl", 0o644)
    resume_config(run_dir, [])
    assert _mode(run_dir) == 0o700
    JsonlLog(run_dir / "events.jsonl").close()  # what the resumed run opens to append
    assert _mode(run_dir / "events.jsonl") == 0o600


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(300)
def test_a_real_run_leaves_nothing_readable_by_others(tmp_path, loose_umask):
    """Two regions on Ray, two rounds: the actors' checkpoints (written in other processes), the
    driver's, the logs, driver-side TLS material and summary.json."""
    cfg = _cfg()
    run_dir = new_run_dir(cfg, str(tmp_path / "run"))
    runner = Runner(cfg, run_dir, show_progress=False)
    try:
        runner.run()
    finally:
        runner.shutdown()
    written = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*")}
    assert {"events.jsonl", "metrics.jsonl", "rounds.jsonl", "summary.json", "tls/ca.key",
            "checkpoints/driver/ckpt-00000001.pt", "checkpoints/us-east-1/ckpt-00000001.pt"} <= written
    assert _open_to_others(run_dir) == []
