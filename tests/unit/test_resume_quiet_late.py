"""Issue 19, trap: a resumed run printed alarming `FAILED_PRECONDITION: late` lines. After a
restore (resume, or a rejoin from a peer) pushes of the rounds around it being refused `late` is
expected: both sides log them at INFO (counted as before), other refusals still warn."""

from __future__ import annotations

import logging
from concurrent.futures import Future

from geofed.orchestrator.config import config_from_mapping
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.p2p.transport import TransportError
from geofed.regions.exchange import ExchangeResult
from geofed.regions.region import Region

REGIONS = ["us-east-1", "eu-west-1"]


def _workers(tmp_path):
    cfg = config_from_mapping({"task": {"kind": "mlp-digits", "hidden": 8}, "regions": {"names": REGIONS},
                               "network": {"emulation": {"mode": "none"}}})
    hub = InMemoryHub()
    workers = {r: Region(cfg, r, tmp_path, transport=InMemoryTransport(r, hub)) for r in REGIONS}
    for w in workers.values():
        w.start()
        w.connect({r: f"inmem:{r}" for r in workers})
    return workers


def test_late_pushes_after_a_restore_are_quiet_and_counted(tmp_path, caplog):
    workers = _workers(tmp_path)
    a, b = workers["us-east-1"], workers["eu-west-1"]
    try:
        a.completed_round = 3
        b.load_state_dict(a.state_dict())  # what --resume does with a checkpoint of round 3
        assert b.transport.mailbox.quiet_late_upto == 4 and b.exchanger.quiet_late_upto == 4
        with caplog.at_level(logging.INFO):
            for round_ in (3, 2):
                try:
                    a.transport.send("eu-west-1", round_, b"x" * 8, timeout_s=5)
                except TransportError as exc:
                    assert exc.reason == "late"
        late = [r for r in caplog.records if "refused a message" in r.getMessage()]
        assert len(late) == 2 and all(r.levelno == logging.INFO for r in late)
        assert b.transport.mailbox.refused["late"] == 2
        # A refusal that is not an expected late one still warns.
        caplog.clear()
        b.transport.mailbox.quiet_late_upto = -1
        with caplog.at_level(logging.INFO):
            try:
                a.transport.send("eu-west-1", 1, b"x" * 8, timeout_s=5)
            except TransportError:
                pass
        assert [r.levelno for r in caplog.records if "refused a message" in r.getMessage()] == [logging.WARNING]
    finally:
        for w in workers.values():
            w.close()


def test_the_sender_logs_an_expected_late_refusal_quietly(tmp_path, caplog):
    workers = _workers(tmp_path)
    ex = workers["us-east-1"].exchanger
    try:
        ex.quiet_late_upto = 4
        for round_, level in ((4, logging.INFO), (5, logging.WARNING)):
            fut = Future()
            fut.set_exception(TransportError("push to eu-west-1 failed: FAILED_PRECONDITION: late: ...",
                                             peer="eu-west-1", reason="late"))
            caplog.clear()
            with caplog.at_level(logging.INFO):
                result = ExchangeResult(received={}, own_decoded={}, missing=[])
                ex._collect_sends({"eu-west-1": fut}, round_, result, grace_s=0.1)
            assert "eu-west-1" in result.send_failures
            assert [r.levelno for r in caplog.records if "send to" in r.getMessage()] == [level]
    finally:
        for w in workers.values():
            w.close()
