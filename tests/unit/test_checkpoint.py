"""Checkpoints (regions/checkpoint.py): atomic (temp file, fsync, rename), checksummed; a torn,
truncated or corrupt file is detected, reported and the previous one used; never runs code."""

from __future__ import annotations

import io
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from geofed.regions import checkpoint
from geofed.regions.checkpoint import CheckpointError


def _state(v: float) -> dict:
    return {"round": int(v), "w": torch.full((64,), v), "note": f"state {v}"}


def _save_rounds(d, rounds):
    for r in rounds:
        checkpoint.save_atomic(checkpoint.checkpoint_path(d, r), _state(float(r)))


def test_round_trip_and_no_temp_file_left(tmp_path):
    path = checkpoint.checkpoint_path(tmp_path, 7)
    checkpoint.save_atomic(path, _state(7.0))
    got = checkpoint.load_verified(path)
    assert torch.equal(got["w"], torch.full((64,), 7.0)) and got["note"] == "state 7.0"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000007.pt"]


@pytest.mark.parametrize("damage", ["truncate", "flip_body", "flip_digest", "bad_magic", "empty"])
def test_damaged_file_is_detected(tmp_path, damage):
    path = checkpoint.checkpoint_path(tmp_path, 1)
    checkpoint.save_atomic(path, _state(1.0))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip_body":
        data[-10] ^= 0x01
    elif damage == "flip_digest":
        data[10] ^= 0x80
    elif damage == "bad_magic":
        data[:4] = b"XXXX"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch|not a geofed checkpoint"):
        checkpoint.load_verified(path)


def test_load_latest_reports_a_corrupt_newest_and_uses_the_previous(tmp_path, caplog):
    _save_rounds(tmp_path, [1, 2, 3])
    newest = checkpoint.checkpoint_path(tmp_path, 3)
    newest.write_bytes(newest.read_bytes()[:-100])  # torn: the disk lost its tail
    skipped = []
    found = checkpoint.load_latest(tmp_path, on_skip=lambda p, why: skipped.append((p, why)))
    assert found is not None and found[0] == 2 and torch.equal(found[1]["w"], torch.full((64,), 2.0))
    assert skipped == [(newest, f"{newest}: checksum mismatch (truncated or corrupt)")]
    assert "skipping checkpoint" in caplog.text and str(newest) in caplog.text


def test_load_latest_at_most_and_nothing_usable(tmp_path):
    _save_rounds(tmp_path, [1, 2, 3])
    assert checkpoint.load_latest(tmp_path, at_most=2)[0] == 2
    assert checkpoint.load_latest(tmp_path, at_most=0) is None
    for r in (1, 2, 3):
        checkpoint.checkpoint_path(tmp_path, r).write_bytes(b"GFCK" + b"\0" * 40)
    skipped = []
    assert checkpoint.load_latest(tmp_path, on_skip=lambda p, why: skipped.append(p)) is None
    assert len(skipped) == 3
    assert checkpoint.load_latest(tmp_path / "missing") is None


def test_a_checkpoint_cannot_run_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    body = io.BytesIO()
    torch.save({"x": Evil()}, body, pickle_module=pickle)
    path = checkpoint.checkpoint_path(tmp_path, 1)
    import hashlib

    raw = body.getvalue()
    checkpoint.write_bytes_atomic(path, checkpoint.MAGIC + hashlib.sha256(raw).digest() + raw)
    with pytest.raises(CheckpointError, match="refused: it holds a Python object"):
        checkpoint.load_verified(path)
    assert not (tmp_path / "pwned").exists()


def test_prune_keeps_the_newest_and_removes_leftover_temp_files(tmp_path):
    _save_rounds(tmp_path, [1, 2, 3, 4])
    leftover = tmp_path / ".ckpt-00000005.pt.tmp-999999"  # a writer killed before its rename
    leftover.write_bytes(b"partial")
    assert checkpoint.list_rounds(tmp_path) == [1, 2, 3, 4]  # never mistaken for a checkpoint
    checkpoint.prune(tmp_path, 2)
    assert checkpoint.list_rounds(tmp_path) == [3, 4] and not leftover.exists()
    with pytest.raises(ValueError, match="keep"):
        checkpoint.prune(tmp_path, 0)


def test_a_failed_write_leaves_the_previous_checkpoint_intact(tmp_path):
    path = checkpoint.checkpoint_path(tmp_path, 1)
    checkpoint.save_atomic(path, _state(1.0))

    class Unsaveable:
        def __reduce__(self):
            raise RuntimeError("disk full, say")

    with pytest.raises(RuntimeError):
        checkpoint.save_atomic(path, {"x": Unsaveable()})
    assert checkpoint.load_verified(path)["round"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


# One interpreter imports torch once (most of the test's time) and forks a writer per line read
# on stdin; it prints the writer's pid, reaps it once the test has SIGKILLed it and says "reaped".
WRITER = textwrap.dedent("""
    import os, sys, torch
    from pathlib import Path
    from geofed.regions import checkpoint
    path = Path(sys.argv[1])
    for _ in sys.stdin:
        pid = os.fork()
        if pid == 0:
            i = 0
            while True:
                i += 1
                checkpoint.save_atomic(path, {"i": i, "w": torch.full((1 << 20,), float(i))})
                print(i, flush=True)
        print("pid", pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)
""")


def test_sigkill_while_writing_never_leaves_a_torn_checkpoint(tmp_path):
    """A process rewriting one 4 MiB checkpoint in a loop is SIGKILLed at arbitrary moments: the
    file that remains always verifies and is one whole state, never a mix."""
    path = checkpoint.checkpoint_path(tmp_path, 0)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        for attempt in range(3):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            pid, saved = None, False
            while pid is None or not saved:  # the pid and at least one completed save, in either order
                line = proc.stdout.readline().split()
                assert line, "the writer ended"
                if line[0] == "pid":
                    pid = int(line[1])
                else:
                    saved = True
            time.sleep(0.05 + 0.07 * attempt)
            os.kill(pid, signal.SIGKILL)
            while proc.stdout.readline().strip() != "reaped":  # the writer's saves until it died
                assert proc.poll() is None
            state = checkpoint.load_verified(path)
            assert torch.equal(state["w"], torch.full((1 << 20,), float(state["i"])))
    finally:
        proc.kill()
        proc.wait(10)
    checkpoint.prune(tmp_path, 2)  # and what the killed writers left half-written goes away
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


STREAMER = textwrap.dedent("""
    import resource, sys, torch
    from pathlib import Path
    from geofed.regions import checkpoint
    state = {"round": 1, "w": [torch.randn(8 << 20), torch.randn(8 << 20)]}  # 64 MiB of tensors
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    checkpoint.save_atomic(Path(sys.argv[1]), state)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
""")


def test_save_streams_to_disk_without_a_copy_of_the_state(tmp_path):
    """A checkpoint's bytes go to the file as torch.save writes them (issue 39): the writer's peak
    memory grows by far less than the state's 64 MiB (through a BytesIO it grew by ~2x the state)."""
    path = checkpoint.checkpoint_path(tmp_path, 1)
    out = subprocess.run([sys.executable, "-c", STREAMER, str(path)], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) < 16, f"peak RSS grew {out.stdout.strip()} MiB while saving 64 MiB"
    state = checkpoint.load_verified(path)
    assert state["round"] == 1 and state["w"][1].numel() == 8 << 20
