"""`geofed bench memory --sizes 1M --arms serial --rounds 2 --H 1 --json`, for real on the session's
Ray: 2 region actors training the 1M-parameter gpt over mutual-TLS gRPC, their peak RSS read from
/proc while the run goes. What is checked is the document's shape and that the number is a number.

New code: this failed with ModuleNotFoundError (geofed.bench.memory) before it."""

from __future__ import annotations

import json
import math

import pytest

from geofed.bench.memory import main

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow, pytest.mark.timeout(600)]


def test_one_arm_at_1m_gives_a_finite_positive_bytes_per_param(tmp_path, capsys, tinyshakespeare_txt):
    out = tmp_path / "bench"
    rc = main(["--sizes", "1M", "--arms", "serial", "--rounds", "2", "--H", "1", "--json", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    doc = json.loads(captured.out)
    assert doc["floor_bytes_per_param"] == 32 and doc["failed"] == []
    (row,) = doc["rows"]
    assert {"arm", "params", "peak_rss_bytes", "baseline_rss_bytes", "bytes_per_param"} <= set(row)
    assert row["arm"] == "serial" and 0.9e6 < row["params"] < 1.1e6
    assert row["peak_rss_bytes"] > row["baseline_rss_bytes"] > 100 << 20  # an actor that imported torch
    assert math.isfinite(row["bytes_per_param"]) and row["bytes_per_param"] > 0
    assert "idle actor" in captured.err and "1M (" in captured.err  # progress on stderr
    run = out / "1M" / "serial"
    assert run.joinpath("rounds.jsonl").read_text().count("\n") == 2
    assert not (run / "checkpoints").exists() and not (run / "model.safetensors").exists()  # freed once measured (no --keep)
