"""Multi-region launch for real: a multi-node Ray cluster on this machine, started from the launch
plan of configs/multi-region.yaml (head + one node per other region, each its own region label,
loopback address, ports and temp dir, token auth on), and `geofed run --address` against it.

The driver runs as a subprocess: this pytest process may already be connected to the session's
local Ray (tests/conftest.py), and one process joins one cluster. The cluster fixture stops only
the processes it started, in its finalizer, whatever the tests did.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import pytest
from geofed.orchestrator.config import load_config
from geofed.orchestrator.launch.plan import build_plan
from geofed.bench.local_cluster import LocalCluster
from geofed.orchestrator.driver.rundir import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "multi-region.yaml"
GEOFED = str(Path(sys.executable).parent / "geofed")
LABEL = "ray.io/availability-region"
ROUNDS = 3
PLACEMENT_TIMEOUT_S = 8

# slow (CI runs `pytest -m slow` after the default suite): four local Ray nodes and four runs take
# about two minutes on 2 cores, which the default suite (well under 20 minutes) cannot spare.
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    plan = build_plan(load_config(CONFIG))
    c = LocalCluster(plan, num_cpus=1, object_store_mb=100, start_timeout_s=90)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def failing_runs(cluster, tmp_path_factory):
    """The two runs that must fail go beside the first test's run (it requests this fixture): the one
    with a region no node carries fails before it creates an actor, so it takes none of the cluster's
    CPUs, and the one pointed where no head answers needs no cluster. Each times itself; the tests
    that read them assert on them."""
    root = tmp_path_factory.mktemp("failing")
    (root / "no-node").mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {"no_node": pool.submit(_timed, _geofed_run, cluster, root / "no-node" / "run", "--set",
                                      "regions.names=[us-east-1, eu-west-1, ap-southeast-2, sa-east-1]", timeout_s=90),
               "no_head": pool.submit(_timed, _no_head_run, root)}


def _timed(run, *args, **kwargs) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = run(*args, **kwargs)
    return proc, time.monotonic() - t0


def _geofed_run(cluster: LocalCluster, out: Path, *overrides: str, timeout_s: float = 150) -> subprocess.CompletedProcess:
    lo, hi = cluster.grpc_port_range
    # --verbose: Ray's own start-up lines (which say it joined the cluster) reach stderr.
    cmd = [GEOFED, "run", str(CONFIG), "--address", cluster.head_address, "--out", str(out), "--no-report", "--quiet", "--verbose",
           "--set", f"run.rounds={ROUNDS}", "--set", "run.eval_every=0", "--set", "task.hidden=256",
           "--set", "sync.policy={kind: fixed, H: 10}", "--set", f"network.port_range=[{lo}, {hi}]",
           "--set", f"regions.placement_timeout_s={PLACEMENT_TIMEOUT_S}", *overrides]
    env = {**cluster.env(), "RAY_DEDUP_LOGS": "0"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=out.parent,
                          check=False)


def _why(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


def test_each_region_runs_on_its_labelled_node_and_updates_cross_over_grpc(cluster, failing_runs, tmp_path):
    proc = _geofed_run(cluster, tmp_path / "run")
    assert proc.returncode == 0, _why(proc)
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == ROUNDS

    # Placement: every region actor on the node the plan labelled with its region.
    ip_of = {n.plan.region: n.ip for n in cluster.nodes}
    placement = summary["placement"]
    assert sorted(placement) == sorted(ip_of)
    for region, where in placement.items():
        assert where["labels"][LABEL] == region, (region, where)
        assert where["node_ip"] == ip_of[region], (region, where)
        # its gRPC server is advertised on that node's address, in the configured port range
        host, port = where["grpc_address"].rsplit(":", 1)
        assert host == ip_of[region] and cluster.grpc_port_range[0] <= int(port) <= cluster.grpc_port_range[1]
    assert len({w["node_id"] for w in placement.values()}) == len(placement)

    # Updates went region to region over geofed's mutual-TLS gRPC: the transports' own counters.
    metrics = read_jsonl(run / "metrics.jsonl")
    assert len(metrics) == ROUNDS * len(placement)
    for region, t in summary["transport"].items():
        assert t["tls"] is True
        assert t["messages_sent"] == t["messages_received"] == ROUNDS * (len(placement) - 1)
        assert t["bytes_sent"] == sum(m["bytes_sent"] for m in metrics if m["region"] == region) > 0
        assert t["bytes_received"] > 0
    # What came back through Ray each round (the metrics record) is small next to the update the
    # region pushed over gRPC with it: the update itself did not travel through Ray. (Overlap:
    # round r reports round r - 1's exchange, so round 0 reports none.)
    for m in metrics:
        if m.get("exchange_round", m["round"]) is not None:
            assert len(json.dumps(m)) * 4 < m["bytes_sent"], (m["region"], m["round"], m["bytes_sent"])
        assert not m["peers_missing"]
    assert summary["refusals"]["total"] == 0
    # The run joined the cluster; it did not start a Ray of its own.
    assert "Connected to Ray cluster" in proc.stderr or "Connecting to existing Ray cluster" in proc.stderr


def test_a_region_without_a_node_fails_fast_naming_it_and_the_labels_seen(cluster, failing_runs):
    proc, elapsed = failing_runs["no_node"].result()
    assert proc.returncode == 1, _why(proc)
    out = proc.stdout + proc.stderr
    assert f"region(s) sa-east-1 ({LABEL}=sa-east-1)" in out, _why(proc)
    for node in cluster.nodes:
        assert f"{node.plan.region} ({node.ip})" in out, _why(proc)  # the labels it saw, with the nodes
    assert f"after {PLACEMENT_TIMEOUT_S}s (regions.placement_timeout_s)" in out
    # bounded: the placement timeout plus the driver's start-up (imports, joining Ray), not a hang
    assert PLACEMENT_TIMEOUT_S <= elapsed < PLACEMENT_TIMEOUT_S + 45
    assert "Traceback" not in out


def test_an_address_where_no_head_answers_fails_within_init_timeout(failing_runs):
    """No cluster needed: nothing listens on the port, the driver gives up after ray.init_timeout_s."""
    (proc, port), elapsed = failing_runs["no_head"].result()
    assert proc.returncode == 1, _why(proc)
    assert f"no Ray head answers at 127.0.0.1:{port} within 3s (ray.init_timeout_s)" in proc.stdout + proc.stderr
    assert elapsed < 60


def _no_head_run(tmp_path: Path) -> tuple[subprocess.CompletedProcess, int]:
    from geofed.bench.local_cluster import free_ports

    port = free_ports("127.0.0.1", 1)[0]
    proc = subprocess.run([GEOFED, "run", str(CONFIG), "--address", f"127.0.0.1:{port}", "--out", str(tmp_path / "run"),
                           "--no-report", "--quiet", "--set", "ray.init_timeout_s=3"],
                          capture_output=True, text=True, timeout=90, cwd=tmp_path, check=False)
    return proc, port


def _ray_looking_pids_not_in(cluster: LocalCluster) -> set[int]:
    ours = set(cluster.alive_pids())
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in ours:
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"raylet" in cmd or b"gcs_server" in cmd:
                out.add(int(entry.name))
    return out


def test_teardown_stops_only_what_the_cluster_started(cluster, failing_runs: dict[str, Future]):
    wait(failing_runs.values())  # the failing runs' drivers are gone before the cluster stops
    # A decoy that looks like Ray to a name-based kill (`ray stop`, pkill raylet): it must survive.
    decoy = subprocess.Popen(["bash", "-c", "exec -a raylet sleep 120"], start_new_session=True)
    try:
        time.sleep(0.2)
        ours = cluster.alive_pids()
        assert len(ours) >= 2 * len(cluster.nodes)  # at least a raylet and a log monitor per node
        others = _ray_looking_pids_not_in(cluster)
        assert decoy.pid in others
        t0 = time.monotonic()
        cluster.stop()
        assert time.monotonic() - t0 < 30
        assert cluster.alive_pids() == []
        assert not any(_alive(p) for p in ours)
        assert not cluster.root.exists()
        assert decoy.poll() is None and _alive(decoy.pid)
    finally:
        decoy.send_signal(signal.SIGKILL)
        decoy.wait(10)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
