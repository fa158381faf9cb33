import json

import pytest

from geofed.bench import link as bench

pytestmark = pytest.mark.timeout(120)


def test_bench_link_json_document(capsys):
    rc = bench.main(["--json", "--sizes", "1", "2", "--repeats", "2", "--mbps", "80", "--latency-ms", "10",
                     "--emulated-sizes", "1", "4", "--emulated-repeats", "2"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["size_mb"], r["tls"]) for r in doc["loopback"]] == [(1, False), (2, False), (1, True), (2, True)]
    assert all(r["mb_s"] > 5 and len(r["mb_s_runs"]) == 2 for r in doc["loopback"])
    keys = {"configured_mbps", "rtt_ms", "size_mb", "goodput_mbps", "goodput_ratio", "sync_s", "limit_s", "estimated_mbps"}
    assert [r["size_mb"] for r in doc["emulated"]] == [1, 4]
    for r in doc["emulated"]:
        assert keys <= r.keys() and r["configured_mbps"] == 80
        assert 15 < r["rtt_ms"] < 60  # 2 x 10 ms configured, plus this busy machine
        assert r["limit_s"] == pytest.approx(r["size_mb"] * 8 / 80 + 0.02, rel=0.01)
        # Loose bounds (2 shared cores); the documented target is <= 1.15 on a quiet machine.
        assert 0.7 < r["sync_s"] / r["limit_s"] < 1.6
        assert 0.6 * 80 < r["estimated_mbps"] < 1.5 * 80
        assert r["goodput_ratio"] == pytest.approx(r["goodput_mbps"] / 80, abs=1e-3)
        assert r["goodput_ratio"] > 0.6  # the documented target is >= 0.95 on a quiet machine


def test_bench_link_table_and_argument_errors(capsys):
    assert bench.main(["--sizes", "1", "--repeats", "1", "--mbps"]) == 0
    out = capsys.readouterr().out
    assert "| size MB | TLS | MB/s | runs |" in out and "mTLS" in out and "emulated WAN" not in out
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "0"])


def test_a_latency_bound_row_has_no_estimate_and_the_table_says_so(capsys):
    # 0.25 MB at 400 Mbit/s over 40 ms each way: 5 ms of bytes behind an 80 ms RTT, under the
    # estimator's exposure floor, so no transfer is a bandwidth sample (as in a run); the bench
    # once crashed on that row.
    assert bench.main(["--sizes", "1", "--repeats", "1", "--mbps", "400", "--latency-ms", "40",
                       "--emulated-sizes", "0.25", "--emulated-repeats", "2"]) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| 400 |")]
    assert len(row) == 1 and row[0].split("|")[9].strip() == "-", out
