"""Issue 36, N2, the time a withholding member costs the honest regions (bench attack's withhold arms
measured 2.44x and 1.64x the undisturbed run's time; the target is 1.5x).

Before: in round 0 every honest region waited the whole initial deadline for the silent member
(30 s with the product default), and in every probation round a whole learnt deadline (>= min_s).
Now the driver tells the regions still waiting that the member reported the round having pushed
nothing to them (senders_done), and a member back on probation is optional for its in-neighbours.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from geofed.bench.adversary import Adversary
from geofed.compression import encode_update
from geofed.orchestrator.driver.run import Runner
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.p2p.grpc_transport import GrpcTransport
from geofed.p2p.mailbox import DONE_GRACE_S
from geofed.p2p.tls import load_tls, make_pki
from geofed.p2p.validate import update_validator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from reliability_harness import events, small_config

SILENT = "ap-northeast-1"  # not the first region: the first evaluates the run's model
REGIONS = ["us-east-1", "eu-west-1", SILENT, "sa-east-1"]
INITIAL_S = 30.0  # the product default (sync.deadline.initial_s)
ROUNDS = 8


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(300)
def test_a_withholding_member_costs_the_honest_regions_seconds_not_deadlines(tmp_path):
    """Real Ray, mutual-TLS gRPC, digits, a member that never pushes. Before this change round 0 alone
    waited the 30 s initial deadline at every honest region (this failed with wait_s 30.0), and its
    probation round (round 3) a learnt deadline."""
    cfg = small_config(regions=REGIONS, rounds=ROUNDS, H=10, run={"checkpoint_every": 0, "eval_every": 0},
                       sync={"policy": {"kind": "fixed", "H": 10}, "inner": {"lr": 0.01},
                             "deadline": {"initial_s": INITIAL_S, "min_s": 0.5, "max_s": 60.0}})
    runner = Runner(cfg, tmp_path, show_progress=False, hostile={SILENT: Adversary(kind="withhold")})
    try:
        summary = runner.run()
    finally:
        runner.shutdown()
    assert summary["rounds"] == ROUNDS
    honest = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["region"] != SILENT]
    waits = {(m["round"], m["region"]): m["wait_s"] for m in honest}
    assert max(waits.values()) < 3.0, sorted(waits.items(), key=lambda kv: -kv[1])[:4]
    # Round 0: the member is missed (its withholding is still seen and muted), no widened deadline.
    assert all(SILENT in m["peers_missing"] for m in honest if m["round"] == 0)
    muted = events(tmp_path, "member_muted")
    assert muted and muted[0]["region"] == SILENT and muted[0]["round"] <= 1, muted
    probations = [e["round"] for e in events(tmp_path, "member_probation")]
    assert probations, "the member was never tried again"
    for m in honest:
        if m["round"] in probations:
            assert m["wait_s"] < 1.5, m  # optional on probation: a grace, not the learnt deadline
    rounds = read_jsonl(tmp_path / "rounds.jsonl")
    print("withholding member, round times:", [round(r["t_end"] - r["t_start"], 2) for r in rounds],
          "max honest wait", round(max(waits.values()), 3), "probations", probations)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("run") / "tls", ["r0", "r1"])


@pytest.mark.timeout(60)
def test_a_delivered_push_is_filed_before_its_sender_hears_the_ack(pki):
    """What DONE_GRACE_S rests on, measured over real mutual-TLS gRPC on loopback: a sender reports
    a push delivered only after the receiver filed it, so a notice that follows the sender's report
    never overtakes an update it claims delivered. 40 pushes of 256 KiB: the update is filed before
    send() returns every time, by a margin the grace does not need."""
    ts = []
    for r in ("r0", "r1"):
        t = GrpcTransport(r, tls=load_tls(pki.directory, r), max_message_bytes=4 << 20)
        t.mailbox.set_validator(update_validator(max_bytes=4 << 20, expected_shapes=[(65536,)]))
        ts.append(t)
    a, b = ts
    addrs = {t.region: t.start() for t in ts}
    for t in ts:
        t.connect(addrs)
    payload = encode_update("identity", [torch.ones(65536)])
    margins = []
    try:
        for r in range(40):
            b.mailbox.expect(r, ["r0"])
            got = {}
            th = threading.Thread(target=lambda r=r, got=got: got.update(inbox=b.receive(r, 5.0)))
            th.start()
            a.send("r1", r, payload, timeout_s=5.0)
            acked = time.monotonic()
            th.join()
            margins.append(acked - got["inbox"].arrivals["r0"].arrived_at)
    finally:
        for t in ts:
            t.close()
    print(f"filed before the ack by: min {min(margins) * 1e3:.2f} ms, median {statistics.median(margins) * 1e3:.2f} ms, "
          f"max {max(margins) * 1e3:.2f} ms; DONE_GRACE_S {DONE_GRACE_S * 1e3:.0f} ms")
    assert min(margins) > 0, margins
