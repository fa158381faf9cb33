"""Issue 40, item 6: the repository's root holds no run output. `r8.jsonl`, an empty file, was
committed at the root with the ternary codec (0657ed0); nothing in geofed writes that name (run
and bench logs go to a run directory under runs/, which is ignored), so it came from a shell
redirect of a command's output. A root-level JSONL file is now ignored by git and none is tracked.

Before the fix this failed with: r8.jsonl tracked, and a new root-level r9.jsonl not ignored."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_git = pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None,
                               reason="needs a git checkout of the repository and the git command")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


@needs_git
def test_no_tracked_file_at_the_root_is_empty_or_a_jsonl_log():
    tracked = [p for p in _git("ls-files").stdout.splitlines() if "/" not in p]
    empty = [p for p in tracked if (ROOT / p).is_file() and (ROOT / p).stat().st_size == 0]
    logs = [p for p in tracked if p.endswith(".jsonl")]
    assert (empty, logs) == ([], [])


@needs_git
def test_a_jsonl_written_at_the_root_is_ignored_and_one_in_a_folder_is_not():
    assert _git("check-ignore", "-q", "--no-index", "r9.jsonl").returncode == 0
    # Test data in JSONL under tests/ or docs/ must stay addable.
    assert _git("check-ignore", "-q", "--no-index", "tests/data/example.jsonl").returncode == 1
